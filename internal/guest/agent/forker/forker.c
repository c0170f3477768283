// forker: the single-threaded process that starts the workloads of a gVisor
// sandbox in their own pid namespace (see IsolatePIDs in ../pidns.go).
//
// The agent starts it with unshare(CLONE_NEWPID) done before its exec, so
// its children land in a new pid namespace; gVisor refuses that unshare to
// a multi-threaded process, and refuses new threads to a process that did
// it, so this cannot be Go. It is freestanding (no libc): see ../pidns.go
// for how it is built and embedded.
//
// argv[1] is the agent's binary; descriptor 3 a SOCK_SEQPACKET socket to
// the agent. It first starts the namespace's init (the agent's binary with
// "pidns-init", its descriptor 3 a pipe on which it says "ok" or what
// failed), drops CAP_SYS_ADMIN from its bounding set (its later children
// lose it at exec) and answers the init's pid. Then, per request (a header,
// groups, then NUL-terminated path, dir, argv and env; descriptors passed
// along are the child's 0, 1, ...), it forks (the child lands in the new
// namespace), applies the attributes as Go's ForkExec does and execs; it
// answers the pid (in the agent's namespace) or minus the errno of the step
// that failed. It reaps its children and sends the agent each exit (this
// gVisor ignores CLONE_PARENT, which would have made them the agent's).

typedef unsigned long u64;
typedef long i64;
typedef int i32;

#define SYS_read 0
#define SYS_write 1
#define SYS_close 3
#define SYS_ioctl 16
#define SYS_dup2 33
#define SYS_sendmsg 46
#define SYS_recvmsg 47
#define SYS_clone 56
#define SYS_execve 59
#define SYS_exit 60
#define SYS_fcntl 72
#define SYS_chdir 80
#define SYS_setuid 105
#define SYS_setgid 106
#define SYS_setpgid 109
#define SYS_setsid 112
#define SYS_setgroups 116
#define SYS_prctl 157
#define SYS_pipe2 293
#define SYS_poll 7
#define SYS_rt_sigprocmask 14
#define SYS_wait4 61
#define SYS_signalfd4 289
#define WNOHANG 1
#define SIG_BLOCK 0
#define SIG_SETMASK 2
#define POLLIN 1

#define CLONE_PARENT 0x00008000
#define SIGCHLD 17
#define O_CLOEXEC 02000000
#define F_SETFD 2
#define F_DUPFD_CLOEXEC 1030
#define FD_CLOEXEC 1
#define MSG_CMSG_CLOEXEC 0x40000000
#define SOL_SOCKET 1
#define SCM_RIGHTS 1
#define TIOCSCTTY 0x540E
#define PR_CAPBSET_DROP 24
#define CAP_SYS_ADMIN 21
#define EINTR 4

#define F_SETSID 1
#define F_SETPGID 2
#define F_SETCTTY 4
#define F_CRED 8

#define MAXFDS 16
#define MAXARGS 8192

static i64 sys6(i64 n, i64 a, i64 b, i64 c, i64 d, i64 e, i64 f) {
	i64 r;
	register i64 r10 __asm__("r10") = d;
	register i64 r8 __asm__("r8") = e;
	register i64 r9 __asm__("r9") = f;
	__asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9) : "rcx", "r11", "memory");
	return r;
}
#define sys(n, a, b, c) sys6(n, (i64)(a), (i64)(b), (i64)(c), 0, 0, 0)

void *memset(void *d, int c, u64 n) {
	char *p = d;
	while (n--)
		*p++ = (char)c;
	return d;
}
void *memcpy(void *d, const void *s, u64 n) {
	char *p = d;
	const char *q = s;
	while (n--)
		*p++ = *q++;
	return d;
}

struct iovec {
	void *base;
	u64 len;
};
struct msghdr {
	void *name;
	i32 namelen;
	struct iovec *iov;
	u64 iovlen;
	void *control;
	u64 controllen;
	i32 flags;
};
struct cmsghdr {
	u64 len;
	i32 level;
	i32 type;
};

// header of a request, then i32 groups[ngroups], then the strings.
struct req {
	i32 flags, uid, gid, ngroups, ctty, argc, envc;
};

static char buf[1 << 18];
static char *argv_[MAXARGS], *envp_[MAXARGS];

static __attribute__((noreturn)) void die(i64 code) {
	for (;;)
		sys(SYS_exit, code, 0, 0);
}

// reply answers a request: kind 0, the pid or minus an errno, what failed.
static void reply(i32 v, const char *text, i64 n) {
	char out[520];
	struct iovec iov = {out, 8};
	i32 kind = 0;
	memcpy(out, &kind, 4);
	memcpy(out + 4, &v, 4);
	if (n > 504)
		n = 504;
	if (n > 0) {
		memcpy(out + 8, text, n);
		iov.len += n;
	}
	struct msghdr m = {0};
	m.iov = &iov;
	m.iovlen = 1;
	sys(SYS_sendmsg, 3, &m, 0);
}

// child: report errno e on p and exit.
static __attribute__((noreturn)) void fail(i32 p, i64 e) {
	i32 v = (i32)-e;
	sys(SYS_write, p, &v, 4);
	die(127);
}

static void start_init(const char *exe) {
	i32 p[2];
	if (sys(SYS_pipe2, p, O_CLOEXEC, 0) < 0) {
		reply(-1, "pipe", 4);
		die(1);
	}
	i64 pid = sys6(SYS_clone, SIGCHLD, 0, 0, 0, 0, 0);
	if (pid == 0) {
		char *av[] = {"dsec-guest", "pidns-init", 0};
		char *ev[] = {0};
		if (sys(SYS_dup2, p[1], 3, 0) < 0)
			die(127);
		sys(SYS_execve, exe, av, ev);
		die(127);
	}
	sys(SYS_close, p[1], 0, 0);
	if (pid < 0) {
		reply((i32)pid, "start the workloads' init", 25);
		die(1);
	}
	char msg[512];
	i64 n = 0;
	for (;;) {
		i64 r = sys(SYS_read, p[0], msg + n, sizeof msg - n);
		if (r == -EINTR)
			continue;
		if (r <= 0)
			break;
		n += r;
		if (n == sizeof msg)
			break;
	}
	sys(SYS_close, p[0], 0, 0);
	if (n != 2 || msg[0] != 'o' || msg[1] != 'k') {
		if (n == 0) {
			reply(-1, "the workloads' init exited before it was ready", 47);
		} else {
			reply(-1, msg, n);
		}
		die(1);
	}
	i64 e = sys(SYS_prctl, PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0);
	if (e < 0) {
		reply((i32)e, "drop CAP_SYS_ADMIN from the bounding set", 40);
		die(1);
	}
	reply((i32)pid, 0, 0);
}

// serve answers one request of n bytes with descriptors fds.
static void serve(i64 n, i32 *fds, i32 nfds) {
	struct req r;
	if (n < (i64)sizeof r) {
		reply(-22, 0, 0);
		return;
	}
	memcpy(&r, buf, sizeof r);
	i64 off = sizeof r;
	if (r.ngroups < 0 || r.ngroups > 1024 || r.argc < 1 || r.argc >= MAXARGS || r.envc < 0 || r.envc >= MAXARGS ||
	    off + 4 * (i64)r.ngroups > n || buf[n - 1] != 0) {
		reply(-22, 0, 0);
		return;
	}
	i32 *groups = (i32 *)(buf + off);
	off += 4 * (i64)r.ngroups;
	char *strs[2];
	i32 want = 2 + r.argc + r.envc, got = 0;
	for (i64 i = off; i < n && got < want; got++) {
		char *s = buf + i;
		while (buf[i])
			i++;
		i++;
		if (got < 2)
			strs[got] = s;
		else if (got < 2 + r.argc)
			argv_[got - 2] = s;
		else
			envp_[got - 2 - r.argc] = s;
	}
	if (got != want) {
		reply(-22, 0, 0);
		return;
	}
	argv_[r.argc] = 0;
	envp_[r.envc] = 0;
	i32 p[2];
	i64 e = sys(SYS_pipe2, p, O_CLOEXEC, 0);
	if (e < 0) {
		reply((i32)e, 0, 0);
		return;
	}
	i64 pid = sys6(SYS_clone, SIGCHLD, 0, 0, 0, 0, 0);
	if (pid == 0) {
		u64 none = 0;
		sys6(SYS_rt_sigprocmask, SIG_SETMASK, (i64)&none, 0, 8, 0, 0);
		if ((r.flags & F_SETSID) && (e = sys(SYS_setsid, 0, 0, 0)) < 0)
			fail(p[1], e);
		if ((r.flags & F_SETPGID) && (e = sys(SYS_setpgid, 0, 0, 0)) < 0)
			fail(p[1], e);
		if (r.flags & F_CRED) {
			if ((e = sys(SYS_setgroups, r.ngroups, groups, 0)) < 0)
				fail(p[1], e);
			if ((e = sys(SYS_setgid, r.gid, 0, 0)) < 0)
				fail(p[1], e);
			if ((e = sys(SYS_setuid, r.uid, 0, 0)) < 0)
				fail(p[1], e);
		}
		if (strs[1][0] && (e = sys(SYS_chdir, strs[1], 0, 0)) < 0)
			fail(p[1], e);
		// Out of the way of 0..nfds-1 first, then into place.
		i32 high[MAXFDS];
		for (i32 i = 0; i < nfds; i++) {
			if ((e = sys(SYS_fcntl, fds[i], F_DUPFD_CLOEXEC, 100)) < 0)
				fail(p[1], e);
			high[i] = (i32)e;
		}
		for (i32 i = 0; i < nfds; i++) {
			if ((e = sys(SYS_dup2, high[i], i, 0)) < 0)
				fail(p[1], e);
		}
		if ((r.flags & F_SETCTTY) && (e = sys(SYS_ioctl, r.ctty, TIOCSCTTY, 1)) < 0)
			fail(p[1], e);
		e = sys(SYS_execve, strs[0], argv_, envp_);
		fail(p[1], e);
	}
	sys(SYS_close, p[1], 0, 0);
	if (pid < 0) {
		sys(SYS_close, p[0], 0, 0);
		reply((i32)pid, 0, 0);
		return;
	}
	i32 v = 0;
	i64 got2;
	do {
		got2 = sys(SYS_read, p[0], &v, 4);
	} while (got2 == -EINTR);
	sys(SYS_close, p[0], 0, 0);
	// A failed child is reaped with the others, its exit sent too: the
	// agent drops what it does not know.
	reply(got2 == 4 ? v : (i32)pid, 0, 0);
}

// reap sends the agent every exit among the forker's children: kind 1,
// pid, wait status, rusage.
static void reap(void) {
	for (;;) {
		char out[12 + 144];
		i32 st = 0;
		i64 pid = sys6(SYS_wait4, -1, (i64)&st, WNOHANG, (i64)(out + 12), 0, 0);
		if (pid == -EINTR)
			continue;
		if (pid <= 0)
			return;
		i32 kind = 1, p = (i32)pid;
		memcpy(out, &kind, 4);
		memcpy(out + 4, &p, 4);
		memcpy(out + 8, &st, 4);
		struct iovec iov = {out, sizeof out};
		struct msghdr m = {0};
		m.iov = &iov;
		m.iovlen = 1;
		sys(SYS_sendmsg, 3, &m, 0);
	}
}

struct pollfd {
	i32 fd;
	short events, revents;
};

void cmain(i64 *sp) {
	i64 argc = sp[0];
	char **argv = (char **)(sp + 1);
	if (argc < 2)
		die(2);
	sys(SYS_fcntl, 3, F_SETFD, FD_CLOEXEC);
	u64 chld = 1ul << (SIGCHLD - 1);
	sys6(SYS_rt_sigprocmask, SIG_BLOCK, (i64)&chld, 0, 8, 0, 0);
	i64 sfd = sys6(SYS_signalfd4, -1, (i64)&chld, 8, O_CLOEXEC, 0, 0);
	if (sfd < 0) {
		reply((i32)sfd, "signalfd", 8);
		die(1);
	}
	start_init(argv[1]);
	for (;;) {
		struct pollfd pfd[2] = {{3, POLLIN, 0}, {(i32)sfd, POLLIN, 0}};
		i64 r = sys(SYS_poll, pfd, 2, -1);
		if (r == -EINTR)
			continue;
		if (r < 0)
			die(1);
		if (pfd[1].revents) {
			char info[128];
			sys(SYS_read, sfd, info, sizeof info);
			reap();
		}
		if (!pfd[0].revents)
			continue;
		char cbuf[sizeof(struct cmsghdr) + 4 * MAXFDS];
		struct iovec iov = {buf, sizeof buf};
		struct msghdr m = {0};
		m.iov = &iov;
		m.iovlen = 1;
		m.control = cbuf;
		m.controllen = sizeof cbuf;
		i64 n = sys(SYS_recvmsg, 3, &m, MSG_CMSG_CLOEXEC);
		if (n == -EINTR)
			continue;
		if (n <= 0)
			die(0); // the agent closed its end
		i32 fds[MAXFDS];
		i32 nfds = 0;
		if (m.controllen >= sizeof(struct cmsghdr)) {
			struct cmsghdr *c = (struct cmsghdr *)cbuf;
			if (c->level == SOL_SOCKET && c->type == SCM_RIGHTS) {
				nfds = (i32)((c->len - sizeof(struct cmsghdr)) / 4);
				if (nfds > MAXFDS)
					nfds = MAXFDS;
				memcpy(fds, cbuf + sizeof(struct cmsghdr), 4 * (u64)nfds);
			}
		}
		serve(n, fds, nfds);
		for (i32 i = 0; i < nfds; i++)
			sys(SYS_close, fds[i], 0, 0);
	}
}

__asm__(".global _start\n"
	"_start:\n"
	"	xor %rbp, %rbp\n"
	"	mov %rsp, %rdi\n"
	"	and $-16, %rsp\n"
	"	call cmain\n"
	"	hlt\n");
