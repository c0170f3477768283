#include "textflag.h"

// noopSignalHandler returns at once: a signal handler, in the kernel's
// calling convention, that does nothing (it returns to the restorer the
// kernel put in the link register, which calls rt_sigreturn).
TEXT noopSignalHandler<>(SB),NOSPLIT|NOFRAME,$0-0
	RET

// func noopSignalHandlerAddr() uintptr
TEXT ·noopSignalHandlerAddr(SB),NOSPLIT,$0-8
	MOVD $noopSignalHandler<>(SB), R0
	MOVD R0, ret+0(FP)
	RET
