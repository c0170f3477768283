// Package undo is a cleanup stack for operations that acquire several
// resources: on failure everything acquired so far is released in reverse
// order; on success the stack is dropped.
//
//	var u undo.Stack
//	defer u.RunUnless(&err)
//	a := acquireA(); u.Push(a.Release)
//	b := acquireB(); u.Push(b.Release)
package undo

// Stack holds release functions. The zero value is ready to use; it is not
// safe for concurrent use.
type Stack struct {
	fns []func()
}

// Push adds a release function.
func (s *Stack) Push(f func()) { s.fns = append(s.fns, f) }

// Run releases everything, newest first, and empties the stack.
func (s *Stack) Run() {
	for i := len(s.fns) - 1; i >= 0; i-- {
		s.fns[i]()
	}
	s.fns = nil
}

// RunUnless runs the stack if *err is non-nil; use it with defer and a
// named error result.
func (s *Stack) RunUnless(err *error) {
	if *err != nil {
		s.Run()
	}
}

// Release drops the stack without running it.
func (s *Stack) Release() { s.fns = nil }
