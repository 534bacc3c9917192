"""The code verifier: a completion's program run against its problem's tests.

The answer of a code problem is JSON (`CodeTests.parse`):

    {"entry_point": "f", "tests": ["assert f(1) == 2", ...]}      assert statements
    {"entry_point": "f", "test_code": "def check(candidate): ..."} HumanEval's check(f),
                                                                   or test_* functions
    {"entry_point": "f", "inputs": [[1], [2]], "outputs": [2, 3]}  calls and results
    {"inputs": ["1 2\\n"], "outputs": ["3\\n"]}                      a script: stdin, stdout

with optional "setup" (code the tests run first: imports, helpers), "call" (the
expression the input/output pairs call, e.g. "Solution().twoSum"), "prefix" (code a
completion continues when it does not define the entry point itself: HumanEval's prompt)
and "compare": "apps" (APPS/TACO: a result also matches [result]).

`code_score` runs in a sandbox worker (rl_jax.rewards._sandbox): it finds the program in
the completion (`extract_program`), starts a child behind the kernel's walls
(rl_jax.rewards._code_jail) and runs the tests *here*, in the worker: the tests'
names for the program's objects are proxies whose calls travel to the child as plain
data, and back. The child never sees a test or an expected value, and every comparison
is made here on plain data (None, bool, int, float, complex, str, bytes, list, tuple,
dict, set, frozenset; anything else stays in the child and equals only itself), so a
program can pass a test only by answering it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import json
import marshal
import math
import os
import re
import select
import shutil
import signal
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

from rl_jax.rewards import _code_jail
from rl_jax.rewards._code_jail import Limits

MAX_FRAME = 4 << 20  # bytes of one answer from the child
MAX_OUTPUT = 1 << 20  # bytes a script may print for one test
MAX_WRITES = 32  # files a program may open for writing
PROGRAM_CHARS = 1 << 16  # characters of a completion the program is looked for in
# Outcomes of one program, as `code_score` reports them (worst first where several hold).
OUTCOMES = (
    "pass",
    "fail",
    "no_code",
    "syntax_error",
    "load_error",
    "missing_entry_point",
    "timeout",
    "crashed",
    "memory",
    "output_limit",
    "refused",
    "protocol",
)


class _Deadline(BaseException):
    """The call's wall time is spent (BaseException: a test's `except Exception` cannot
    swallow it)."""


class _ChildGone(BaseException):
    """The child died, or answered with something that is not an answer."""

    def __init__(self, outcome: str):
        super().__init__(outcome)
        self.outcome = outcome


class ProgramError(Exception):
    """An exception the program raised that has no builtin class of that name."""


# ---- the tests --------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeTests:
    entry_point: str = ""
    call: str = ""  # expression the input/output pairs call ('' = entry_point)
    tests: tuple[str, ...] = ()  # statements, one test each
    test_code: str = ""
    setup: str = ""
    inputs: tuple = ()
    outputs: tuple = ()
    prefix: str = ""
    compare: str = "exact"
    test_functions: tuple[str, ...] = field(default=(), compare=False)

    @property
    def script(self) -> bool:
        """Input/output pairs of a script (stdin -> stdout) rather than of a function."""
        return bool(self.inputs) and not (self.entry_point or self.call)

    @property
    def total(self) -> int:
        if self.inputs:
            return len(self.inputs)
        if self.test_code:
            return len(self.test_functions) or 1
        return len(self.tests)

    @staticmethod
    def parse(answer: str) -> CodeTests:
        """The tests of a code problem's answer (JSON: module docstring); ValueError
        naming what is wrong."""
        try:
            spec = json.loads(answer)
        except (TypeError, ValueError) as e:
            raise ValueError(f"code answer is not JSON ({e})") from None
        if isinstance(spec, list):
            spec = {"tests": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"code answer is a JSON {type(spec).__name__}, expected an object")
        known = {f for f in CodeTests.__dataclass_fields__ if f != "test_functions"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"code answer has unknown fields {unknown}; known: {sorted(known)}")
        for k in ("entry_point", "call", "test_code", "setup", "prefix", "compare"):
            if not isinstance(spec.get(k, ""), str):
                raise ValueError(f"code answer field {k!r} must be a string")
        tests = spec.get("tests", [])
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise ValueError("code answer field 'tests' must be a list of strings")
        inputs, outputs = spec.get("inputs", []), spec.get("outputs", [])
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("code answer fields 'inputs' and 'outputs' must be lists")
        if len(inputs) != len(outputs):
            raise ValueError(f"code answer has {len(inputs)} inputs but {len(outputs)} outputs")
        if spec.get("compare", "exact") not in ("exact", "apps"):
            raise ValueError("code answer field 'compare' must be 'exact' or 'apps'")
        # Every field is checked above: strings, and lists (tests, inputs, outputs) as tuples.
        out = CodeTests(**{k: tuple(v) if type(v) is list else v for k, v in spec.items()})
        if out.script and not all(isinstance(x, str) for x in inputs + outputs):
            raise ValueError("a script's inputs and outputs (no entry_point) must be strings")
        if not out.script and inputs and not all(isinstance(x, list) for x in inputs):
            raise ValueError("a function's inputs must be lists of arguments")
        if out.test_code:
            fns = tuple(re.findall(r"^def (test_\w*)\s*\(", out.test_code, re.M))
            out = dataclasses.replace(
                out, test_functions=() if "def check(" in out.test_code else fns
            )
        if out.total == 0:
            raise ValueError("code answer has no tests (tests, test_code or inputs/outputs)")
        if out.test_code and not out.test_functions and not out.entry_point:
            raise ValueError("a test_code with check(candidate) needs an entry_point")
        return out


def encode_tests(**spec) -> str:
    """A code problem's answer (JSON text, sorted keys) from CodeTests' fields."""
    spec = {k: v for k, v in spec.items() if v not in ("", (), [], None)}
    CodeTests.parse(json.dumps(spec))  # refuse what the verifier would refuse
    return json.dumps(spec, sort_keys=True)


# ---- the program in a completion ----------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PY_LANGS = ("", "python", "py", "python3", "py3")
_CODE_START = re.compile(r"^(?:def |class |import |from |async def |@)", re.M)
_STOP = re.compile(r"^(?:def |class |if __name__|print\(|assert |```)", re.M)


def _defines(program: str, name: str) -> bool:
    if not name:
        return True
    n = re.escape(name)
    # [ \t], not \s: a definition is on one line, and \s* from every line start over a run
    # of blank lines would take time quadratic in its length.
    found = re.search(rf"^[ \t]*(?:async[ \t]+def|def|class)[ \t]+{n}\b|^{n}[ \t]*=", program, re.M)
    return found is not None


def _compiles(src: str) -> bool:
    # A program's SyntaxWarnings ("invalid decimal literal") are not the trainer's to print.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(src, "<program>", "exec")
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return False
    return True


def extract_program(completion: str, tests: CodeTests) -> str | None:
    """The program a completion gives: its last Python code block that defines the entry
    point (else its last code block), else the text itself (the part after a </think>);
    a text that does not define the entry point continues `tests.prefix` up to the next
    top-level statement; prose around bare code is trimmed until it compiles. None when
    there is nothing to run."""
    text = completion[-PROGRAM_CHARS:]
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    entry = "" if tests.script else tests.entry_point or _called_name(tests)
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PY_LANGS]
    if blocks:
        program = next((b for b in reversed(blocks) if _defines(b, entry)), blocks[-1])
    else:
        program = text
    if not _defines(program, entry) and tests.prefix:
        body = program
        cut = _STOP.search(body, 1)
        return tests.prefix + (body[: cut.start()] if cut else body)
    if not program.strip():
        return None
    if _compiles(program) or blocks:
        return program
    start = _CODE_START.search(program)
    if start is None:
        return program
    lines = program[start.start() :].splitlines()
    for end in range(len(lines), max(len(lines) - 20, 0), -1):
        candidate = "\n".join(lines[:end])
        if _compiles(candidate):
            return candidate
    return program


def well_formed(completion: object) -> bool:
    """Whether a completion holds something to run: a code block or a definition."""
    from rl_jax.rewards._text import bounded_text

    text = bounded_text(completion, limit=PROGRAM_CHARS, keep="tail")
    return "```" in text or re.search(r"^(?:def|class) \w", text, re.M) is not None


def _called_name(tests: CodeTests) -> str:
    for t in tests.tests:
        m = re.search(r"\b([A-Za-z_]\w*)\s*\(", t.replace("assert", " ", 1))
        if m and m.group(1) not in dir(builtins):
            return m.group(1)
    return ""


# ---- values between here and the child ------------------------------------------------------


def _tagged(x, depth: int = 0):
    """A test's value as the tagged form the child reads (rl_jax.rewards._code_child)."""
    if depth > 100:
        raise ValueError("argument nested too deeply")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [_tagged(v, depth + 1) for v in x]
    if t is tuple:
        return {"t": [_tagged(v, depth + 1) for v in x]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [_tagged(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[_tagged(k, depth + 1), _tagged(v, depth + 1)] for k, v in x.items()]}
    if t is bytes or t is bytearray:
        return {"b" if t is bytes else "B": x.decode("latin-1")}
    if t is complex:
        return {"c": [x.real, x.imag]}
    if t is _Remote:
        return {"h": object.__getattribute__(x, "_h")}
    raise TypeError(f"a {t.__name__} cannot be passed to the program (plain data only)")


_PLAIN = (type(None), bool, int, float, str)


def _untagged(x, session: _Session):
    """A child's answer as a value, strictly: plain data and handles, nothing else."""
    t = type(x)
    if t in _PLAIN:
        return x
    if t is list:
        return [_untagged(v, session) for v in x]
    if t is not dict or len(x) != 1:
        raise _ChildGone("protocol")
    ((tag, v),) = x.items()
    try:
        if tag == "t":
            return tuple(_untagged(e, session) for e in _as_list(v))
        if tag in ("s", "f"):
            items = (_untagged(e, session) for e in _as_list(v))
            return set(items) if tag == "s" else frozenset(items)
        if tag == "d":
            return {_untagged(k, session): _untagged(e, session) for k, e in _pairs(v)}
        if tag in ("b", "B") and type(v) is str:
            return (bytes if tag == "b" else bytearray)(v.encode("latin-1"))
        if tag == "c" and type(v) is list and len(v) == 2:
            return complex(float(v[0]), float(v[1]))
        if tag == "h" and type(v) is int and not isinstance(v, bool) and v >= 0:
            return session.remote(v)
    except (TypeError, UnicodeEncodeError, ValueError):  # unhashable keys, bad bytes
        pass
    raise _ChildGone("protocol")


def _as_list(v) -> list:
    if type(v) is not list:
        raise _ChildGone("protocol")
    return v


def _pairs(v) -> list:
    out = _as_list(v)
    if not all(type(p) is list and len(p) == 2 for p in out):
        raise _ChildGone("protocol")
    return out


def _plain_listed(x):
    """Tuples as lists, all the way down (JSON expected values have no tuples)."""
    if type(x) in (list, tuple):
        return [_plain_listed(v) for v in x]
    if type(x) is dict:
        return {k: _plain_listed(v) for k, v in x.items()}
    return x


# ---- the session with one child -----------------------------------------------------------


class _Remote:
    """A program object the tests hold: calls and reads travel to the child. Compares
    equal only to itself; its truth, length, items and iteration are the child's."""

    __slots__ = ("_s", "_h", "__weakref__")

    def __init__(self, session: _Session, h: int):
        object.__setattr__(self, "_s", session)
        object.__setattr__(self, "_h", h)

    def __ask(self, op: str, **kw):
        h = object.__getattribute__(self, "_h")
        return object.__getattribute__(self, "_s").ask(op, h=h, **kw)

    def __call__(self, *args, **kw):
        return object.__getattribute__(self, "_s").call(self, args, kw)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self.__ask("getattr", name=name)

    def __iter__(self):
        it = self.__ask("iter")
        if type(it) is not _Remote:
            raise _ChildGone("protocol")
        while True:
            try:
                yield it.__ask("next")
            except StopIteration:
                return

    def __len__(self) -> int:
        return self.__ask("len")

    def __bool__(self) -> bool:
        return self.__ask("bool")

    def __getitem__(self, key):
        return self.__ask("getitem", key=_tagged(key))

    def __contains__(self, key) -> bool:
        return self.__ask("contains", key=_tagged(key))

    def __repr__(self) -> str:
        return f"<program object {object.__getattribute__(self, '_h')}>"

    __eq__ = object.__eq__
    __hash__ = object.__hash__


_BUILTIN_ERRORS = {
    name: cls
    for name, cls in vars(builtins).items()
    if isinstance(cls, type) and issubclass(cls, Exception)
}


class _Session:
    """Requests to one child and its answers, within the call's deadline."""

    def __init__(self, child: _code_jail.Child, deadline: float):
        self.child, self.deadline = child, deadline
        self.refused = 0
        self.errors: list[str] = []  # exception names the program raised
        self._remotes: dict[int, _Remote] = {}

    def remote(self, h: int) -> _Remote:
        r = self._remotes.get(h)
        if r is None:
            r = self._remotes[h] = _Remote(self, h)
        return r

    def _wait(self, fd: int, write: bool) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _Deadline
        r, w, _ = select.select([] if write else [fd], [fd] if write else [], [], left)
        if not (r or w):
            raise _Deadline

    def _read(self, n: int) -> bytes:
        chunks = []
        while n:
            self._wait(self.child.resp, write=False)
            b = os.read(self.child.resp, min(n, 1 << 20))
            if not b:
                raise _ChildGone("crashed")
            chunks.append(b)
            n -= len(b)
        return b"".join(chunks)

    def request(self, msg: dict) -> dict:
        data = marshal.dumps(msg)
        data = len(data).to_bytes(4, "big") + data
        os.set_blocking(self.child.req, False)
        while data:
            self._wait(self.child.req, write=True)
            try:
                data = data[os.write(self.child.req, data) :]
            except BlockingIOError:
                continue
            except BrokenPipeError:
                raise _ChildGone("crashed") from None
        n = int.from_bytes(self._read(4), "big")
        if n > MAX_FRAME:
            raise _ChildGone("protocol")
        try:
            ans = json.loads(self._read(n))
        except (ValueError, RecursionError):
            raise _ChildGone("protocol") from None
        if type(ans) is not dict:
            raise _ChildGone("protocol")
        r = ans.get("r")
        if type(r) is int:
            self.refused = max(self.refused, r)
        return ans

    def ask(self, op: str, **msg):
        """The value the child answers `op` with, or the exception it reports, raised."""
        return self._value(self.request({"op": op, **msg}))

    def _value(self, ans: dict):
        """The value of an answer, or the exception it reports, raised."""
        if "v" in ans and "x" not in ans:
            return _untagged(ans["v"], self)
        x = ans.get("x")
        if not (type(x) is list and len(x) == 2 and all(type(s) is str for s in x)):
            raise _ChildGone("protocol")
        name, msg = x
        self.errors.append(name)
        if name == "StopIteration":
            raise StopIteration
        try:  # the builtin class of that name, where one takes a message alone
            error = _BUILTIN_ERRORS.get(name, ProgramError)(f"{name}: {msg}"[:300])
        except TypeError:  # UnicodeDecodeError and kin
            error = ProgramError(f"{name}: {msg}"[:300])
        raise error

    def call(self, fn: _Remote, args: tuple, kw: dict):
        ans = self.request(
            {
                "op": "call",
                "h": object.__getattribute__(fn, "_h"),
                "args": [_tagged(a) for a in args],
                "kw": {"d": [[str(k), _tagged(v)] for k, v in kw.items()]},
            }
        )
        value = self._value(ans)
        changed = _untagged(ans.get("a", []), self)
        if type(changed) is list:
            for a, new in zip(args, changed, strict=False):
                _write_back(a, new)
        return value


def _write_back(arg, new) -> None:
    """An argument the call changed in place, changed here too."""
    if type(arg) is list and type(new) is list or type(arg) is bytearray and type(new) is bytearray:
        arg[:] = new
    elif type(arg) is dict and type(new) is dict or type(arg) is set and type(new) is set:
        arg.clear()
        arg.update(new)


# ---- running the tests --------------------------------------------------------------------


def _same_output(got: str, want: str) -> bool:
    """A script's stdout against the expected: equal up to trailing whitespace, else
    token by token (numbers within 1e-6)."""
    g = [line.rstrip() for line in got.strip().splitlines()]
    if g == [line.rstrip() for line in want.strip().splitlines()]:
        return True
    gt, wt = got.split(), want.split()
    if gt == wt:
        return True
    if len(gt) != len(wt):
        return False
    try:
        return all(
            a == b or math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
            for a, b in zip(gt, wt, strict=True)
        )
    except ValueError:
        return False


def _same_value(got, want, compare: str) -> bool:
    got = _plain_listed(got)
    if got == want:
        return True
    return compare == "apps" and type(want) is list and len(want) == 1 and got == want[0]


def _attempt(s: _Session, ok: list[bool], test) -> None:
    """`test()`'s verdict appended to `ok`: failed where it returns False or raises."""
    try:
        ok.append(test() is not False)
    except (_Deadline, _ChildGone):
        raise
    except Exception as e:  # noqa: BLE001 - a failed test
        s.errors.append(type(e).__name__)
        ok.append(False)


def _run_script(s: _Session, program: str, tests: CodeTests, ok: list[bool]) -> str:
    """Each input/output pair: the program run as a script on the input; `ok` gets a
    verdict per pair as it is made (a script that raised fails its pair)."""

    def run(stdin: str, want: str) -> bool:
        got = s.ask("run", src=program, stdin=stdin)
        if type(got) is not str:
            raise _ChildGone("protocol")
        return _same_output(got, want)

    for stdin, want in zip(tests.inputs, tests.outputs, strict=True):
        _attempt(s, ok, lambda i=stdin, w=want: run(i, w))
    return "pass" if all(ok) else "fail"


def _namespace(s: _Session, program: str, tests: CodeTests) -> dict:
    """The tests' namespace: the program's top-level names (proxies for its objects),
    then the tests' own setup and code."""
    loaded = s.ask("load", src=program)
    if type(loaded) is not dict:
        raise _ChildGone("protocol")
    ns: dict = {"__builtins__": builtins, "__name__": "__tests__"}
    ns.update({k: v for k, v in loaded.items() if type(k) is str})
    for code in (tests.setup, tests.test_code):
        if code:
            exec(compile(code, "<tests>", "exec"), ns)  # the dataset's code, not the model's
    return ns


def _run_functions(s: _Session, program: str, tests: CodeTests, ok: list[bool]) -> str:
    """The program loaded once, then each test in this process against proxies of its
    objects; `ok` gets a verdict per test as it is made."""
    try:
        ns = _namespace(s, program, tests)
        if tests.entry_point and tests.entry_point not in ns:
            return "missing_entry_point"
        target = eval(tests.call or tests.entry_point, ns) if tests.inputs else None  # noqa: S307
    except (_Deadline, _ChildGone):
        raise
    except Exception:  # noqa: BLE001 - the program failed at import
        return "load_error"

    if tests.inputs:
        for args, want in zip(tests.inputs, tests.outputs, strict=True):
            _attempt(s, ok, lambda a=args, w=want: _same_value(target(*a), w, tests.compare))
    elif tests.test_code and not tests.test_functions:
        _attempt(s, ok, lambda: ns["check"](ns[tests.entry_point]) and None)
    elif tests.test_code:
        for name in tests.test_functions:
            _attempt(s, ok, lambda n=name: ns[n]() and None)
    else:
        for t in tests.tests:
            code = compile(t, "<test>", "exec")
            _attempt(s, ok, lambda c=code: exec(c, ns))  # noqa: S102 - the dataset's test
    return "pass" if all(ok) else "fail"


@contextlib.contextmanager
def _alarm(deadline: float):
    """SIGALRM at the deadline (raising _Deadline) where this is the main thread: it stops
    a test's own loop between calls to the child."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum, frame):
        raise _Deadline

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _died_of(status: int) -> str:
    """What ended a child that stopped answering: its CPU limit (or a kill) is a timeout,
    its file-size limit an output limit, anything else a crash."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return "timeout"
        if sig == signal.SIGXFSZ:
            return "output_limit"
    return "crashed"


@functools.cache
def _read_roots() -> tuple[str, ...]:
    """What a program may read besides its directory: the modules of the Python it runs
    on, and the harmless devices."""
    return (*_code_jail.python_paths()[1], "/dev/null", "/dev/urandom", "/dev/zero")


def code_score(
    completion: str, answer: str, time_s: float, memory_mb: int, off: tuple[str, ...] = ()
) -> tuple[int, int, str, int]:
    """(tests passed, tests, outcome, operations refused) of a completion's program
    against the code problem `answer` (JSON), within `time_s` seconds of wall time and
    `memory_mb` MiB of address space. Runs in a sandbox worker (it forks).

    off: layers left out (tests of one layer at a time): 'audit', 'seccomp',
    'landlock', 'netns'."""
    deadline = time.monotonic() + time_s
    tests = CodeTests.parse(answer)
    program = extract_program(completion, tests)
    if program is None:
        return 0, tests.total, "no_code", 0
    if not _compiles(program):
        return 0, tests.total, "syntax_error", 0
    tmp = tempfile.mkdtemp(prefix="rl_jax_code_")
    child, s, ok, status = None, None, [], 0
    try:
        # Started before the alarm is armed: an alarm between the fork and `child` being
        # set would leave the child unkilled.
        limits = Limits(time_s=time_s, memory_mb=memory_mb)
        child = _code_jail.spawn(tmp, limits, off=frozenset(off))
        with _alarm(deadline):
            s = _Session(child, deadline)
            s.ask(
                "setup",
                tmp=tmp,
                read_roots=_read_roots(),
                max_writes=MAX_WRITES,
                max_frame=MAX_FRAME,
                max_output=MAX_OUTPUT,
                audit="audit" not in off,
            )
            run = _run_script if tests.script else _run_functions
            outcome = run(s, program, tests, ok)
    except _Deadline:
        outcome = "timeout"
    except _ChildGone as e:
        outcome = e.outcome
    finally:
        if child is not None:
            status = child.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if outcome == "crashed":
        outcome = _died_of(status)
    elif outcome in ("fail", "load_error") and s is not None:
        # Why it failed, where the program said: out of memory, or a refused operation.
        if "MemoryError" in s.errors:
            outcome = "memory"
        elif s.refused:
            outcome = "refused"
    return sum(ok), tests.total, outcome, s.refused if s is not None else 0
