#include "textflag.h"

// noopSignalHandler returns at once: a signal handler, in the kernel's
// calling convention, that does nothing (the restorer then calls
// rt_sigreturn).
TEXT noopSignalHandler<>(SB),NOSPLIT|NOFRAME,$0-0
	RET

// func noopSignalHandlerAddr() uintptr
TEXT ·noopSignalHandlerAddr(SB),NOSPLIT,$0-8
	LEAQ noopSignalHandler<>(SB), AX
	MOVQ AX, ret+0(FP)
	RET
