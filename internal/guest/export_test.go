package guest

// SetIdleBudget sets the process's budget of idle kept connections for a
// test and returns the function that restores it.
func SetIdleBudget(n int64) (restore func()) {
	old := idleBudget
	idleBudget = func() int64 { return n }
	return func() { idleBudget = old }
}
