"""Starting the code verifier's child process inside the kernel's walls.

`spawn(tmp, limits)` forks the calling sandbox worker (single-threaded, so Python runs
safely in the fork) and, in the child, before it execs a fresh `python -I -S -B`:

- own session and process group (the parent kills the whole group with SIGKILL at the
  end of every call), and SIGKILL when the parent dies (PR_SET_PDEATHSIG);
- the call's temporary directory as cwd; stdin/stdout/stderr /dev/null; the request and
  answer pipes on fds 3 and 4; every other descriptor closed;
- resource limits: address space, CPU seconds, file size, open files, no core dumps;
- a network namespace of its own, where the kernel lets us make one (root, or
  unprivileged user namespaces): no interface but a loopback that is down;
- Landlock (Linux >= 5.13, where enabled): reads only beneath the Python install and
  the system libraries, writes only beneath the call's directory, no TCP bind/connect
  (ABI >= 4), no signals or abstract sockets out of its domain (ABI >= 6);
- seccomp-bpf (x86_64, aarch64): no fork (clone only with CLONE_THREAD: threads), no
  execve but the one exec of Python that follows (matched by the address of its path
  argument, which a new program cannot reproduce), no sockets, no signals to another
  process, no ptrace, namespaces, mounts, BPF, io_uring, keyrings, modules.

Each layer that the kernel refuses (no Landlock, no namespaces) is left out and said in
`layers()`; rlimits, the session and the audit hook inside the child always hold.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CHILD_SOURCE = (Path(__file__).with_name("_code_child.py")).read_text()
FILE_SIZE_LIMIT = 8 << 20  # bytes one file may grow to (RLIMIT_FSIZE)
OPEN_FILES_LIMIT = 64  # descriptors (RLIMIT_NOFILE)


@dataclass(frozen=True)
class Limits:
    time_s: float  # wall time of the whole call (the parent kills the group at it)
    memory_mb: int  # address space of the child (RLIMIT_AS)


# ---- constants --------------------------------------------------------------------------

_PR_SET_PDEATHSIG, _PR_SET_SECCOMP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
_SECCOMP_MODE_FILTER = 2
_CLONE_NEWNET, _CLONE_THREAD = 0x40000000, 0x00010000
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06

# Syscall numbers per machine: first the ones the filter reads specially (`_SPECIAL`), then
# every syscall a program never needs, denied with EPERM (clone3 with ENOSYS, so that glibc
# falls back to clone, whose flags the filter can read).
_SPECIAL = frozenset(("arch", "clone", "clone3", "execve", "kill", "tgkill"))
_X86_64 = dict(
    arch=0xC000003E,
    clone=56, clone3=435, execve=59, kill=62, tgkill=234,
    fork=57, vfork=58, execveat=322, socket=41, socketpair=53, ptrace=101, tkill=200,
    rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_open=434, pidfd_send_signal=424,
    pidfd_getfd=438, process_vm_readv=310, process_vm_writev=311, process_madvise=440,
    kcmp=312, unshare=272, setns=308, mount=165, umount2=166, pivot_root=155, chroot=161,
    bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425, io_uring_enter=426,
    io_uring_register=427, keyctl=250, add_key=248, request_key=249, kexec_load=246,
    init_module=175, finit_module=313, delete_module=176, reboot=169, swapon=167,
    swapoff=168, acct=163, settimeofday=164, clock_settime=227, sethostname=170,
    setdomainname=171, iopl=172, ioperm=173, open_by_handle_at=304, name_to_handle_at=303,
    fanotify_init=300, quotactl=179, lookup_dcookie=212, vhangup=153, syslog=103,
    personality=135, mknod=133, mknodat=259,
)  # fmt: skip
_AARCH64 = dict(
    arch=0xC00000B7,
    clone=220, clone3=435, execve=221, kill=129, tgkill=131,
    execveat=281, socket=198, socketpair=199, ptrace=117, tkill=130, rt_sigqueueinfo=138,
    rt_tgsigqueueinfo=240, pidfd_open=434, pidfd_send_signal=424, pidfd_getfd=438,
    process_vm_readv=270, process_vm_writev=271, process_madvise=440, kcmp=272,
    unshare=97, setns=268, mount=40, umount2=39, pivot_root=41, chroot=51, bpf=280,
    perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
    io_uring_register=427, keyctl=219, add_key=217, request_key=218, kexec_load=104,
    init_module=105, finit_module=273, delete_module=106, reboot=142, swapon=224,
    swapoff=225, acct=89, settimeofday=170, clock_settime=112, sethostname=161,
    setdomainname=162, open_by_handle_at=265, name_to_handle_at=264, fanotify_init=262,
    quotactl=60, lookup_dcookie=18, vhangup=58, syslog=116, personality=92, mknodat=33,
)  # fmt: skip
_SYSCALLS = {"x86_64": _X86_64, "amd64": _X86_64, "aarch64": _AARCH64, "arm64": _AARCH64}

# Landlock (include/uapi/linux/landlock.h).
_LL_CREATE, _LL_ADD_RULE, _LL_RESTRICT = 444, 445, 446
_FS_EXECUTE, _FS_WRITE, _FS_READ, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REMOVE_DIR, _FS_REMOVE_FILE, _FS_MAKE_DIR, _FS_MAKE_REG = 1 << 4, 1 << 5, 1 << 7, 1 << 8
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14
_NET_ALL = 0b11  # BIND_TCP | CONNECT_TCP
_SCOPE_ALL = 0b11  # ABSTRACT_UNIX_SOCKET | SIGNAL


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort),
        ("jt", ctypes.c_ubyte),
        ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


# ---- what the kernel offers -------------------------------------------------------------


@cache
def python_paths() -> tuple[str, tuple[str, ...]]:
    """(the real Python executable, its module search path under -I -S)."""
    exe = os.path.realpath(sys.executable)
    out = subprocess.run(
        [exe, "-I", "-S", "-c", "import sys; print('\\n'.join(sys.path))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return exe, tuple(p for p in out.splitlines() if p)


@cache
def landlock_abi() -> int:
    if _LIBC is None:
        return 0
    abi = _LIBC.syscall(_LL_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


@cache
def _netns_allowed() -> bool:
    if _LIBC is None:
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _LIBC.unshare(_CLONE_NEWNET) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def layers() -> dict[str, bool]:
    """Which kernel layers this host gives a child (the rest always apply)."""
    return {
        "session + group kill": True,
        "rlimits": True,
        "parent-death signal": _LIBC is not None,
        "seccomp": _LIBC is not None and platform.machine().lower() in _SYSCALLS,
        "landlock": landlock_abi() > 0,
        "network namespace": _netns_allowed(),
    }


# ---- the filters ------------------------------------------------------------------------


def seccomp_program(table: dict, *, pid: int, exec_ptr: int) -> list[tuple[int, int, int, int]]:
    """The BPF program (code, jt, jf, k) of the seccomp filter for a child `pid` whose one
    allowed execve passes `exec_ptr` as its path."""
    prog: list[list] = []  # [code, jt-label or 0, jf-label or 0, k]
    labels: dict[str, int] = {}

    def op(code, k, jt=0, jf=0):
        prog.append([code, jt, jf, k])

    op(_LD_ABS, 4)  # arch
    op(_JEQ, table["arch"], 0, "kill")
    op(_LD_ABS, 0)  # syscall number
    if table is _X86_64:
        op(_JGE, 0x40000000, "deny", 0)  # the x32 ABI
    for name, nr in table.items():
        if name not in _SPECIAL:
            op(_JEQ, nr, "deny", 0)
    op(_JEQ, table["clone3"], "nosys", 0)
    op(_JEQ, table["clone"], "clone", 0)
    op(_JEQ, table["kill"], "self", 0)
    op(_JEQ, table["tgkill"], "self", 0)
    op(_JEQ, table["execve"], "exec", 0)
    op(_RET, _RET_ALLOW)
    labels["clone"] = len(prog)
    op(_LD_ABS, 16)  # flags, low word
    op(_JSET, _CLONE_THREAD, "allow", "deny")
    labels["self"] = len(prog)
    op(_LD_ABS, 16)  # pid / tgid (pid_t: the low word is what the kernel reads)
    op(_JEQ, pid, "allow", "deny")
    labels["exec"] = len(prog)
    op(_LD_ABS, 16)
    op(_JEQ, exec_ptr & 0xFFFFFFFF, 0, "deny")
    op(_LD_ABS, 20)
    op(_JEQ, exec_ptr >> 32, "allow", "deny")
    for name, ret in (
        ("allow", _RET_ALLOW),
        ("deny", _RET_ERRNO | errno.EPERM),
        ("nosys", _RET_ERRNO | errno.ENOSYS),
        ("kill", _RET_KILL),
    ):
        labels[name] = len(prog)
        op(_RET, ret)
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out.append((code, jt, jf, k))
    return out


def _install_seccomp(pid: int, exec_ptr: int) -> None:
    table = _SYSCALLS[platform.machine().lower()]
    prog = seccomp_program(table, pid=pid, exec_ptr=exec_ptr)
    arr = (_SockFilter * len(prog))(*[_SockFilter(*ins) for ins in prog])
    fprog = _SockFprog(len(prog), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))
    if _LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp filter refused")


def _landlock_rule(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this host does not have
    try:
        if not os.path.isdir(path):
            access &= _FS_EXECUTE | _FS_WRITE | _FS_READ | _FS_TRUNCATE
        attr = _PathBeneath(access, fd)
        if _LIBC.syscall(_LL_ADD_RULE, ruleset, 1, ctypes.byref(attr), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock rule for {path} refused")
    finally:
        os.close(fd)


def _install_landlock(abi: int, tmp: str, exe: str, roots: tuple[str, ...]) -> None:
    fs = (1 << 13) - 1
    fs |= _FS_REFER if abi >= 2 else 0
    fs |= _FS_TRUNCATE if abi >= 3 else 0
    fs |= (1 << 15) if abi >= 5 else 0
    attr = _RulesetAttr(fs, _NET_ALL if abi >= 4 else 0, _SCOPE_ALL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = _LIBC.syscall(_LL_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock ruleset refused")
    read = _FS_EXECUTE | _FS_READ | _FS_READ_DIR
    try:
        for p in {"/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", os.path.dirname(exe)}:
            _landlock_rule(ruleset, p, read)
        for p in roots:
            _landlock_rule(ruleset, p, _FS_READ | _FS_READ_DIR)
        _landlock_rule(ruleset, "/dev/null", _FS_READ | _FS_WRITE)
        work = _FS_WRITE | _FS_READ | _FS_READ_DIR | _FS_REMOVE_DIR | _FS_REMOVE_FILE
        work |= _FS_MAKE_DIR | _FS_MAKE_REG | (_FS_TRUNCATE if abi >= 3 else 0)
        _landlock_rule(ruleset, tmp, work)
        if _LIBC.syscall(_LL_RESTRICT, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock restriction refused")
    finally:
        os.close(ruleset)


# ---- the child --------------------------------------------------------------------------


def _set_limits(limits: Limits) -> None:
    mem = limits.memory_mb << 20
    cpu = int(limits.time_s) + 1
    for res, soft, hard in (
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_FSIZE, FILE_SIZE_LIMIT, FILE_SIZE_LIMIT),
        (resource.RLIMIT_NOFILE, OPEN_FILES_LIMIT, OPEN_FILES_LIMIT),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(res, (soft, hard))


def _in_child(
    tmp: str, limits: Limits, req_r: int, resp_w: int, parent: int, off: frozenset[str]
) -> None:
    """Runs in the forked child: the walls, then exec. Never returns."""
    import fcntl

    os.setsid()
    # Lift the pipes above the descriptors they go to, so that no dup2 overwrites one.
    req_r = fcntl.fcntl(req_r, fcntl.F_DUPFD, 100)
    resp_w = fcntl.fcntl(resp_w, fcntl.F_DUPFD, 100)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.dup2(req_r, 3)
    os.dup2(resp_w, 4)
    os.closerange(5, max(os.sysconf("SC_OPEN_MAX"), 1 << 16))
    os.chdir(tmp)
    exe, roots = python_paths()
    if _netns_allowed() and "netns" not in off:
        _LIBC.unshare(_CLONE_NEWNET)
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
        if _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "no_new_privs refused")
        if landlock_abi() and "landlock" not in off:
            _install_landlock(landlock_abi(), tmp, exe, roots)
    path = ctypes.create_string_buffer(os.fsencode(exe))
    argv = [path.value, b"-s", b"-S", b"-B", b"-P", b"-c", CHILD_SOURCE.encode()]
    # A clean environment; a fixed hash seed so that a program's set and dict order, and
    # so its reward, repeat on a resumed run.
    env = [b"PYTHONHASHSEED=0", b"MALLOC_ARENA_MAX=2", b"LC_ALL=C.UTF-8", b"TMPDIR=" + tmp.encode(),
           b"HOME=" + tmp.encode(), b"PATH="]  # fmt: skip
    argv_c = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
    env_c = (ctypes.c_char_p * (len(env) + 1))(*env, None)
    if layers()["seccomp"] and "seccomp" not in off:
        _install_seccomp(os.getpid(), ctypes.addressof(path))
    # Last: below the forked worker's own size, any allocation here would fail.
    _set_limits(limits)
    if _LIBC is not None:
        _LIBC.execve(path, argv_c, env_c)
    else:
        os.execve(exe, [a.decode() for a in argv], dict(e.decode().split("=", 1) for e in env))
    os._exit(127)


@dataclass
class Child:
    pid: int
    req: int  # the parent's end of the request pipe (write)
    resp: int  # the parent's end of the answer pipe (read)

    def kill(self) -> int:
        """SIGKILL to the child's process group; returns once every member is reaped
        (orphans come to this process, a subreaper). The child's wait status."""
        for fd in (self.req, self.resp):
            try:
                os.close(fd)
            except OSError:
                pass
        # Until its setsid() the child is in this process's group, not its own: it is
        # killed by its pid too, and reaped by it where the group's wait does not find it.
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # gone; the child may still be a zombie
                pass
        status = None
        while True:
            try:
                pid, st = os.waitpid(-self.pid, 0)
            except ChildProcessError:
                break
            if pid == self.pid:
                status = st
        if status is None:
            try:
                status = os.waitpid(self.pid, 0)[1]
            except ChildProcessError:
                status = 0
        return status


_subreaper = False


def spawn(tmp: str, limits: Limits, *, off: frozenset[str] = frozenset()) -> Child:
    """A child running rl_jax.rewards._code_child in `tmp` behind every layer the host
    offers (module docstring) but those named in `off` (tests: one layer at a time);
    the caller must `kill()` it."""
    global _subreaper
    layers()  # decided once, before the fork (the probes fork themselves)
    python_paths()
    if not _subreaper and _LIBC is not None:
        # Orphans of the child's group come here, to be reaped by Child.kill.
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _subreaper = True
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _in_child(tmp, limits, req_r, resp_w, parent, off)
        finally:
            os._exit(126)
    os.close(req_r)
    os.close(resp_w)
    return Child(pid=pid, req=req_w, resp=resp_r)
