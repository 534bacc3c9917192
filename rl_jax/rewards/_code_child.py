"""The sandboxed side of the code verifier: one untrusted program in a fresh interpreter.

Started by rl_jax.rewards._code as `python -I -S -B -c <this file's source>` after the
kernel layers are in place (its own session, resource limits, seccomp, Landlock). Stdlib
only, and only modules the interpreter has at startup plus `marshal` and `_json`, so a
start costs milliseconds.

It knows nothing of the tests. The parent sends requests on fd 3 (marshal: the parent
is trusted) and reads answers on fd 4 (JSON text, which the parent decodes strictly):
load the program, run it as a script on some stdin, call one of its objects, read an
attribute, iterate. Every comparison with an expected value happens in the parent, so
nothing the program does here (printing "PASS", exiting, patching this file's
functions, answering requests itself) can make a test pass that its answers do not.

Before the program runs, an audit hook (PEP 578) refuses what a solution never needs:
processes, signals to others, sockets, native-code loaders, files outside the call's
directory (reading: the Python install too), changing directory, raising limits. The
hook reads nothing it could be made to misread: its policy and the builtins it calls
are bound as default arguments (setting a function's code or defaults is itself an
audited event it refuses), and it calls no Python-level library function.
"""

import marshal
import os
import sys
from _json import encode_basestring_ascii as _json_str

REQ_FD, RESP_FD = 3, 4
MAX_DEPTH = 200  # nesting of a value sent to the parent
# A handle names an object the parent cannot hold as data (a function, an instance...).
MAX_HANDLES = 100_000

_DENY_EVENTS = frozenset(
    (
        "os.system",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "os.startfile",
        "os.chdir",
        "os.fchdir",
        "os.chroot",
        "os.symlink",
        "os.link",
        "os.mkfifo",
        "os.mknod",
        "os.setxattr",
        "os.removexattr",
        "subprocess.Popen",
        "signal.pthread_kill",
        "sys.addaudithook",
        "resource.setrlimit",
        "resource.prlimit",
        "sqlite3.connect",
        "sqlite3.connect/handle",
        "sqlite3.enable_load_extension",
        "shutil.chown",
        "webbrowser.open",
        "syslog.openlog",
    )
)
_DENY_PREFIXES = ("os.exec", "os.posix_spawn", "os.spawn", "socket.", "ctypes.", "pty.")
# Modules whose job is what the sandbox forbids, or that read files natively (outside the
# audited `open`): never imported by a program here.
_DENY_MODULES = frozenset(
    (
        "ctypes",
        "_ctypes",
        "cffi",
        "_cffi_backend",
        "subprocess",
        "_posixsubprocess",
        "multiprocessing",
        "_multiprocessing",
        "_posixshmem",
        "socket",
        "_socket",
        "ssl",
        "_ssl",
        "pty",
        "termios",
        "pwd",
        "grp",
        "spwd",
        "crypt",
        "_crypt",
        "nis",
        "readline",
        "_curses",
        "curses",
        "_tkinter",
        "tkinter",
        "_sqlite3",
        "sqlite3",
        "dbm",
        "_dbm",
        "_gdbm",
        "_testcapi",
        "_testinternalcapi",
        "_xxsubinterpreters",
        "_xxinterpchannels",
    )
)
# Attributes whose assignment would rewrite a function (the hook's own included).
_GUARDED_ATTRS = frozenset(("__code__", "__defaults__", "__kwdefaults__", "__globals__"))
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITE_EVENTS = frozenset(
    (
        "os.remove",
        "os.rmdir",
        "os.rename",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "shutil.rmtree",
        "shutil.copyfile",
        "shutil.copytree",
        "shutil.move",
        "shutil.make_archive",
        "shutil.unpack_archive",
    )
)
_READ_EVENTS = frozenset(("os.listdir", "os.scandir", "glob.glob", "os.walk"))


def _normpath(path, cwd, _str=str, _type=type):
    """`path` made absolute against `cwd` with '.' and '..' resolved as text."""
    if _type(path) is not _str:
        return None
    if not path.startswith("/"):
        path = cwd + "/" + path
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
        else:
            parts.append(part)
    return "/" + "/".join(parts)


def _is_dir(path, stat, _oserror=OSError):
    try:
        return (stat(path).st_mode & 0o170000) == 0o040000
    except _oserror:
        return False


def make_hook(tmp, read_roots, max_writes):
    """The audit hook: `tmp` (the call's directory) read and written, `read_roots` (the
    Python install, /dev/null...) read; at most `max_writes` files opened for writing.
    Returns (hook, counters) where counters[0] counts refusals, counters[1] writes."""
    counters = [0, 0]

    def hook(
        event,
        args,
        _deny=_DENY_EVENTS,
        _prefixes=_DENY_PREFIXES,
        _mods=_DENY_MODULES,
        _guarded=_GUARDED_ATTRS,
        _wevents=_WRITE_EVENTS,
        _revents=_READ_EVENTS,
        _tmp=tmp,
        _roots=tuple(read_roots),
        _limit=max_writes,
        _n=counters,
        _file=_file_reason,
        _error=PermissionError,
    ):
        reason = None
        if event in _deny or event.startswith(_prefixes):
            reason = event
        elif event == "import":
            if args[0].partition(".")[0] in _mods:
                reason = "import " + args[0]
        elif event == "object.__setattr__" or event == "object.__delattr__":
            if args[1] in _guarded:
                reason = event + " " + args[1]
        elif event == "open" or event in _wevents or event in _revents:
            reason = _file(event, args, _tmp, _roots, _limit, _n)
        if reason is not None:
            _n[0] += 1
            raise _error("rl_jax sandbox refused: " + reason)

    return hook, counters


def _file_reason(
    event,
    args,
    _tmp,
    _roots,
    _limit,
    _n,
    _wflags=_WRITE_FLAGS,
    _wevents=_WRITE_EVENTS,
    _norm=_normpath,
    _fsdecode=os.fsdecode,
    _stat=os.stat,
    _is_dir=_is_dir,
    _type=type,
    _str=str,
    _bytes=bytes,
    _int=int,
    _len=len,
):
    """Why the hook refuses a file event (None: allowed): a write outside `_tmp` or past
    `_limit` opened files (counted in _n[1]), a read outside `_tmp` and `_roots`, a
    directory opened outside `_tmp`, a move or copy out of `_tmp`. Bound like the hook."""
    path = args[0] if _len(args) else None
    if path is None or _type(path) is _int:
        return None  # the current directory, or a descriptor the program already holds
    if _type(path) is _bytes:
        path = _fsdecode(path)
    where = _norm(path, _tmp)
    if event == "open":
        mode, flags = args[1], args[2]
        write = (mode is not None and ("w" in mode or "a" in mode or "x" in mode or
                 "+" in mode)) or (flags and flags & _wflags)  # fmt: skip
    else:
        write = event in _wevents
    inside = where is not None and (where == _tmp or where.startswith(_tmp + "/"))
    reason = None
    if where is None:
        reason = event + " of a path that is not text"
    elif write and not inside:
        reason = event + " for writing outside the call's directory: " + where
    elif write and event == "open":
        _n[1] += 1
        if _n[1] > _limit:
            reason = "more than " + _str(_limit) + " files opened for writing"
    elif not write and not inside:
        for root in _roots:
            if where == root or where.startswith(root + "/"):
                break
        else:
            reason = event + " outside the call's directory: " + where
        if reason is None and event == "open" and _is_dir(where, _stat):
            # A directory's descriptor would resolve paths (dir_fd) where this
            # hook, which resolves against the call's directory, cannot follow.
            reason = "open of a directory outside the call's directory: " + where
    if event in ("os.rename", "shutil.copyfile", "shutil.move") and not reason:
        dst = _norm(args[1] if _type(args[1]) is _str else "", _tmp)
        if dst is None or not (dst == _tmp or dst.startswith(_tmp + "/")):
            reason = event + " to outside the call's directory"
    return reason


# ---- values to and from the parent ----------------------------------------------------


class _Handles:
    """Objects the parent refers to by number (it holds only their numbers)."""

    def __init__(self):
        self.objs = []
        self.ids = {}

    def add(self, obj):
        key = id(obj)
        h = self.ids.get(key)
        if h is None:
            if len(self.objs) >= MAX_HANDLES:
                raise MemoryError("too many objects handed to the tests")
            h = self.ids[key] = len(self.objs)
            self.objs.append(obj)
        return h


def _float_json(x):
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    return float.__repr__(x)


def to_json(x, handles, parts, budget, depth=0):
    """Append `x` as tagged JSON to `parts` (see rl_jax.rewards._code for the tags);
    subclasses of plain types travel as their plain base; anything else as a handle.
    `budget` is a one-element list of characters left (OverflowError when spent)."""
    if depth > MAX_DEPTH:
        raise RecursionError("value nested too deeply")
    if budget[0] < 0:
        raise OverflowError("value too large")
    if x is None:
        parts.append("null")
    elif x is True or x is False:
        parts.append("true" if x else "false")
    elif isinstance(x, int):
        text = int.__repr__(x)
        budget[0] -= len(text)
        parts.append(text)
    elif isinstance(x, float):
        parts.append(_float_json(float.__float__(x)))
    elif isinstance(x, str):
        text = _json_str(str.__str__(x))
        budget[0] -= len(text)
        parts.append(text)
    elif isinstance(x, list | tuple | set | frozenset | dict):
        _container_json(x, handles, parts, budget, depth)
    elif isinstance(x, bytes | bytearray):
        tag = "b" if isinstance(x, bytes) else "B"
        text = _json_str(bytes(x).decode("latin-1"))
        budget[0] -= len(text)
        parts.append('{"' + tag + '":' + text + "}")
    elif isinstance(x, complex):
        c = complex.__complex__(x)
        parts.append('{"c":[' + _float_json(c.real) + "," + _float_json(c.imag) + "]}")
    else:
        parts.append('{"h":' + str(handles.add(x)) + "}")


def _container_json(x, handles, parts, budget, depth):
    if isinstance(x, dict):
        parts.append('{"d":[')
        for i, (k, v) in enumerate(dict.items(x)):
            parts.append(",[" if i else "[")
            to_json(k, handles, parts, budget, depth + 1)
            parts.append(",")
            to_json(v, handles, parts, budget, depth + 1)
            parts.append("]")
        parts.append("]}")
        return
    if isinstance(x, list):
        items, head, tail = list.__iter__(x), "[", "]"
    elif isinstance(x, tuple):
        items, head, tail = tuple.__iter__(x), '{"t":[', "]}"
    elif isinstance(x, frozenset):
        items, head, tail = frozenset.__iter__(x), '{"f":[', "]}"
    else:
        items, head, tail = set.__iter__(x), '{"s":[', "]}"
    parts.append(head)
    for i, v in enumerate(items):
        if i:
            parts.append(",")
        budget[0] -= 1
        to_json(v, handles, parts, budget, depth + 1)
    parts.append(tail)


def from_tagged(x, handles):
    """A value the parent sent (its tagged form, trusted) as a Python object."""
    if isinstance(x, list):
        return [from_tagged(v, handles) for v in x]
    if not isinstance(x, dict):
        return x
    ((tag, v),) = x.items()
    if tag == "t":
        return tuple(from_tagged(e, handles) for e in v)
    if tag == "s":
        return {from_tagged(e, handles) for e in v}
    if tag == "f":
        return frozenset(from_tagged(e, handles) for e in v)
    if tag == "d":
        return {from_tagged(k, handles): from_tagged(e, handles) for k, e in v}
    if tag == "b":
        return v.encode("latin-1")
    if tag == "B":
        return bytearray(v.encode("latin-1"))
    if tag == "c":
        return complex(v[0], v[1])
    return handles.objs[v]  # "h"


# ---- the request loop -----------------------------------------------------------------


def _read_exact(n):
    chunks, left = [], n
    while left:
        b = os.read(REQ_FD, min(left, 1 << 20))
        if not b:
            raise EOFError
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def _recv():
    return marshal.loads(_read_exact(int.from_bytes(_read_exact(4), "big")))


def _send(text):
    data = text.encode("utf-8", "surrogatepass")
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(RESP_FD, data) :]


class _CappedBytes:
    """stdout's bytes for a script run: at most `limit` bytes, then OSError."""

    def __init__(self, limit):
        import io

        self.buf, self.limit = io.BytesIO(), limit

    def writable(self):
        return True

    def readable(self):
        return False

    def seekable(self):
        return False

    def write(self, b):
        if self.buf.tell() + len(b) > self.limit:
            raise OSError("output limit reached")
        return self.buf.write(b)

    def flush(self):
        pass

    @property
    def closed(self):
        return False


# Requests on one object that take nothing else.
_UNARY = {"iter": iter, "next": next, "len": len, "bool": bool}


class Server:
    def __init__(self, setup):
        self.setup = setup
        self.handles = _Handles()
        self.ns = None
        self.counters = [0, 0]

    def answer(self, value, extra=""):
        parts = []
        to_json(value, self.handles, parts, [self.setup["max_frame"]])
        return '{"v":' + "".join(parts) + extra + ',"r":' + str(self.counters[0]) + "}"

    def error(self, e, extra=""):
        try:
            msg = str(e)[:200] if not isinstance(e, RecursionError) else "recursion"
        except BaseException:  # noqa: BLE001 - a program's exception whose str raises
            msg = ""
        parts = []
        to_json([type(e).__name__, msg], self.handles, parts, [4096])
        return '{"x":' + "".join(parts) + extra + ',"r":' + str(self.counters[0]) + "}"

    def handle(self, req):
        op = req["op"]
        if op == "load":
            return self.load(req)
        if op == "run":
            return self.run(req)
        obj = self.handles.objs[req["h"]]
        if op == "call":
            args = from_tagged(req["args"], self.handles)
            kw = from_tagged(req["kw"], self.handles)
            value = obj(*args, **kw)
            # Arguments the call may have changed in place go back with the result.
            changed = [a if isinstance(a, list | dict | set | bytearray) else None for a in args]
            parts = [',"a":']
            to_json(changed, self.handles, parts, [self.setup["max_frame"]])
            return self.answer(value, "".join(parts))
        if op in _UNARY:
            return self.answer(_UNARY[op](obj))
        if op == "getattr":
            return self.answer(getattr(obj, req["name"]))
        if op == "getitem":
            return self.answer(obj[from_tagged(req["key"], self.handles)])
        if op == "contains":
            return self.answer(from_tagged(req["key"], self.handles) in obj)
        raise ValueError(f"unknown request {op!r}")

    def load(self, req):
        """Run the program as a module named `solution` (a `__main__` block stays off);
        its top-level names go back as small scalars or handles, modules by name."""
        self.ns = {"__name__": "solution", "__builtins__": __builtins__}
        exec(compile(req["src"], "<program>", "exec"), self.ns)
        parts, modules = ['{"d":['], []
        for k, v in list(self.ns.items()):
            if k.startswith("__"):
                continue
            if type(v) is type(sys):
                modules.append(k)
                continue
            parts.append(("," if len(parts) > 1 else "") + "[" + _json_str(k) + ",")
            if type(v) in (int, float, bool, type(None)) or (type(v) is str and len(v) < 4096):
                to_json(v, self.handles, parts, [1 << 20])
            else:
                parts.append('{"h":' + str(self.handles.add(v)) + "}")
            parts.append("]")
        parts.append(']},"m":')
        to_json(modules, self.handles, parts, [1 << 20])
        return '{"v":' + "".join(parts) + ',"r":' + str(self.counters[0]) + "}"

    def run(self, req):
        """The program as a script on `stdin`; its stdout (what it printed until it
        finished or raised) and the exception it ended with, if any."""
        import io

        raw = _CappedBytes(self.setup["max_output"])
        out = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", write_through=True)
        stdin = io.TextIOWrapper(io.BytesIO(req["stdin"].encode("utf-8", "replace")), "utf-8")
        saved = sys.stdin, sys.stdout
        sys.stdin, sys.stdout = stdin, out
        exc = None
        try:
            exec(compile(req["src"], "<program>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            if e.code not in (None, 0):
                exc = e
        except BaseException as e:  # noqa: BLE001 - the program's failure, reported
            exc = e
        finally:
            try:
                out.flush()
            except BaseException as e:  # noqa: BLE001
                exc = exc or e
            sys.stdin, sys.stdout = saved
        text = raw.buf.getvalue().decode("utf-8", "replace")
        if exc is not None:
            return self.error(exc, ',"out":' + _json_str(text))
        return self.answer(text)


def main():
    import signal

    # Writing past RLIMIT_FSIZE is an OSError (EFBIG) for the program, not a crash.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    setup = _recv()
    server = Server(setup)
    hook, server.counters = make_hook(setup["tmp"], setup["read_roots"], setup["max_writes"])
    if setup["audit"]:
        sys.addaudithook(hook)
    del hook
    _send('{"v":null,"r":0}')
    while True:
        try:
            req = _recv()
        except BaseException:  # noqa: BLE001 - the parent has gone or sent garbage
            break
        try:
            text = server.handle(req)
        except BaseException as e:  # noqa: BLE001 - the program's exception, reported
            try:
                text = server.error(e)
            except BaseException:  # noqa: BLE001 - even its name could not be sent
                text = '{"x":["Exception",""],"r":0}'
        try:
            _send(text)
        except BaseException:  # noqa: BLE001
            break
    # Never a normal interpreter exit: finalization clears audit hooks before running
    # objects' __del__ methods.
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    finally:
        os._exit(0)
