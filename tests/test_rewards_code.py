"""The code verifier: test layouts, program extraction, verdicts, options, and each
sandbox layer on its own (rl_jax.rewards._code, _code_jail, _code_child)."""

import json
import os

import pytest

from rl_jax import rewards
from rl_jax.config import RunConfig, apply_overrides
from rl_jax.knobs import ConfigError
from rl_jax.rewards import _code_jail
from rl_jax.rewards._code import CodeTests, encode_tests, extract_program

pytestmark = pytest.mark.skipif(not _code_jail.layers()["rlimits"], reason="POSIX only")

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def code():
    return rewards.get("code", scale="01", timeout_s=TIMEOUT_S, workers=2)


def _asserts(name="f", cases=((1, 2), (5, 6))):
    return json.dumps(
        {"entry_point": name, "tests": [f"assert {name}({a}) == {b}" for a, b in cases]}
    )


# ---- layouts of the answer --------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, why",
    [
        ("not json", "not JSON"),
        ('"x"', "expected an object"),
        ('{"tests": ["assert f(1)"], "bogus": 1}', "unknown fields ['bogus']"),
        ('{"inputs": [[1]], "outputs": []}', "1 inputs but 0 outputs"),
        ('{"entry_point": "f"}', "no tests"),
        ('{"tests": [1]}', "list of strings"),
        ('{"inputs": [1], "outputs": ["1"]}', "must be strings"),
        ('{"entry_point": "f", "inputs": [1], "outputs": [1]}', "lists of arguments"),
        ('{"tests": ["x"], "compare": "fuzzy"}', "'exact' or 'apps'"),
    ],
)
def test_bad_answers_are_named(answer, why):
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("(", r"\(")):
        CodeTests.parse(answer)


def test_answer_shorthands_and_counts():
    assert CodeTests.parse('["assert f(1) == 1", "assert f(2) == 2"]').total == 2
    t = CodeTests.parse(json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]}))
    assert t.script and t.total == 1
    code = "def test_a():\n    assert f(1)\n\ndef test_b():\n    pass\n"
    t = CodeTests.parse(json.dumps({"entry_point": "f", "test_code": code}))
    assert t.test_functions == ("test_a", "test_b") and t.total == 2
    t = CodeTests.parse(json.dumps({"entry_point": "f", "test_code": "def check(c):\n  pass"}))
    assert t.total == 1
    with pytest.raises(ValueError, match="unknown fields"):
        encode_tests(entry_point="f", tests=["assert f(1)"], nonsense=1)


# ---- the program in a completion --------------------------------------------------------


def test_extract_program():
    t = CodeTests.parse(_asserts())
    fenced = (
        "Here:\n```python\ndef g():\n    pass\n```\nand\n```python\ndef f(n):\n    return n\n```"
    )
    assert extract_program(fenced, t).startswith("def f(n)")
    # the last block that defines the entry point wins over a later usage example
    later = fenced + "\n```python\nprint(f(1))\n```"
    assert extract_program(later, t).startswith("def f(n)")
    assert extract_program("```py\ndef f(n): return n\n", t) == "def f(n): return n\n"  # cut off
    assert extract_program("<think>def f(n): bad</think>def f(n): return 1", t) == (
        "def f(n): return 1"
    )
    prose = "Sure! Here is the function.\ndef f(n):\n    return n + 1\nThis adds one."
    assert extract_program(prose, t) == "def f(n):\n    return n + 1"
    assert extract_program("   \n", t) is None
    # HumanEval: the completion continues the prompt's signature, cut at the next statement
    he = CodeTests.parse(json.dumps({**json.loads(_asserts()), "prefix": "def f(n):\n"}))
    assert (
        extract_program("    return n + 1\n\nprint(f(3))", he) == "def f(n):\n    return n + 1\n\n"
    )


def test_a_programs_syntax_warnings_are_not_printed():
    import warnings

    from rl_jax.rewards._code import _compiles

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _compiles("x = [0x1for x in y]")  # SyntaxWarning: invalid hexadecimal literal
    assert not seen


# ---- verdicts -----------------------------------------------------------------------------


def test_asserts_pass_fail_and_partial_credit(code):
    ans = _asserts(cases=((1, 2), (5, 6), (0, 1)))
    right, partly = "def f(n):\n    return n + 1", "def f(n):\n    return 5 if n == 0 else n + 1"
    out = code.batch([right, partly, "def g(n): pass", "def f(:"], [ans] * 4)
    assert out.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert code.last_outcomes == ["pass", "fail", "missing_entry_point", "syntax_error"]
    partial = rewards.get("code", scale="01", timeout_s=TIMEOUT_S, workers=2, partial=True)
    assert partial.batch([right, partly], [ans] * 2).tolist() == pytest.approx([1.0, 2 / 3])
    pm1 = rewards.get("code", scale="pm1", timeout_s=TIMEOUT_S, workers=2)
    assert pm1.batch([right, partly], [ans] * 2).tolist() == [1.0, -1.0]


def test_test_layouts(code):
    pairs = json.dumps({"entry_point": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})
    tup = json.dumps({"entry_point": "pair", "inputs": [[1]], "outputs": [[1, 2]]})
    apps = json.dumps(
        {"entry_point": "add", "inputs": [[1, 2]], "outputs": [[3]], "compare": "apps"}
    )
    script = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10"]})
    check = json.dumps(
        {"entry_point": "inc", "test_code": "def check(candidate):\n    assert candidate(1) == 2\n"}
    )
    raises = json.dumps(
        {
            "entry_point": "root",
            "setup": "import math",
            # the program's ValueError arrives in the tests as a ValueError
            "test_code": (
                "def test_value():\n    assert math.isclose(root(4), 2.0)\n\n"
                "def test_negative():\n    try:\n        root(-1)\n    except ValueError:\n"
                "        return\n    raise AssertionError('no ValueError')\n"
            ),
        }
    )
    leet = json.dumps(
        {
            "entry_point": "Solution",
            "call": "Solution().twoSum",
            "inputs": [[[2, 7, 11], 9]],
            "outputs": [[0, 1]],
        }
    )
    inplace = json.dumps(
        {"entry_point": "srt", "tests": ["xs = [3, 1, 2]\nsrt(xs)\nassert xs == [1, 2, 3]"]}
    )
    cases = [
        ("def add(a, b):\n    return a + b", pairs),
        ("def pair(n):\n    return (n, n + 1)", tup),  # a tuple result matches a JSON list
        ("def add(a, b):\n    return a + b", apps),
        ("a, b = map(int, input().split())\nprint(a + b)\nimport sys\nsys.exit(0)", script),
        ("def inc(n):\n    return n + 1", check),
        ("import math\ndef root(x):\n    return math.sqrt(x)", raises),
        (
            "class Solution:\n    def twoSum(self, xs, t):\n"
            "        return [i for i in range(len(xs)) for j in range(i) if xs[i] + xs[j] == t][:0]"
            " or [0, 1]",
            leet,
        ),
        ("def srt(xs):\n    xs.sort()", inplace),
    ]
    out = code.batch([c for c, _ in cases], [a for _, a in cases])
    assert out.tolist() == [1.0] * len(cases), code.last_outcomes
    wrong = ["def add(a, b):\n    return a - b", "print(3)", "def srt(xs):\n    return sorted(xs)"]
    assert code.batch(wrong, [pairs, script, inplace]).tolist() == [0.0] * 3


def test_results_compare_as_plain_data_only(code):
    ans = json.dumps({"entry_point": "f", "tests": ["assert f(1) == [1, (2, 3), {'a': {4}}]"]})
    good = "def f(n):\n    return [1, (2, 3), {'a': {4}}]"
    tricks = [
        "class A:\n    def __eq__(self, o):\n        return True\ndef f(n):\n    return A()",
        "class L(list):\n    def __eq__(self, o):\n        return True\ndef f(n):\n    return L()",
        "def f(n):\n    return [1, [2, 3], {'a': {4}}]",  # a list is not the tuple asked for
    ]
    assert code.batch([good, *tricks], [ans] * 4).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_verdict_is_not_the_programs_to_give(code):
    """Printing PASS, exiting 0 early, forging an answer frame, patching the harness or
    the builtins the tests use: none passes a test the program does not answer."""
    ans = _asserts()
    spoofs = [
        "print('PASS')\nprint('OK: 2/2 tests passed')\ndef f(n):\n    return 0",
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "import os\nos.write(4, (16).to_bytes(4, 'big') + b'{\"v\":true,\"r\":0}')\n"
        "def f(n):\n    return 0",
        "import sys\nsys.modules['__main__'].Server.answer = "
        "lambda self, v, extra='': '{\"v\":true,\"r\":0}'\ndef f(n):\n    return 0",
        "import builtins\nbuiltins.AssertionError = type('E', (BaseException,), {})\n"
        "def f(n):\n    return 0",
        "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef f(n):\n    return 0",
        "def f(n):\n    import sys\n    sys.exit(0)",
    ]
    assert code.batch(spoofs, [ans] * len(spoofs)).tolist() == [0.0] * len(spoofs)
    assert code("def f(n):\n    print('FAIL')\n    return n + 1", ans) == 1.0


def test_outcome_classes(code):
    ans = _asserts()
    progs = {
        "timeout": "def f(n):\n    while True:\n        pass",
        "memory": "def f(n):\n    return len(bytearray(1 << 40))",
        "crashed": "import os\ndef f(n):\n    os.abort()",
        "load_error": "raise ValueError('at import')",
        "no_code": "",
        "refused": "def f(n):\n    open('/etc/hostname').read()\n    return n + 1",
    }
    out = code.batch(list(progs.values()), [ans] * len(progs))
    assert out.tolist() == [0.0] * len(progs)
    assert code.last_outcomes == list(progs)
    assert code.outcomes["timeout"] >= 1
    assert code.well_formed("```python\nx\n```") and code.well_formed("def f(): pass")
    assert not code.well_formed("The answer is 4.")


def test_blank_output_is_no_code_not_a_timeout(code):
    # A degenerate completion of blank lines (64 Ki of them, what the verifier reads).
    assert code("\n" * 65536, _asserts()) == 0.0
    assert code.last_outcomes == ["no_code"]
    assert code(" \t\n" * 20000 + "def f(n):\n    return n + 1\n", _asserts()) == 1.0


def test_a_bad_answer_is_no_credit_not_a_crash(code, caplog):
    assert code("def f(n): return 1", "{not json") == 0.0
    assert code.last_outcomes == ["bad_tests"]
    assert "code verifier: no credit" in caplog.text


def test_options_and_knobs():
    with pytest.raises(ValueError, match="takes no option 'partial'"):
        rewards.get("arith", partial=True)
    assert rewards.options("code") == ("partial", "memory_mb")
    cfg = apply_overrides(RunConfig(), ["rewards.code_partial=true", "rewards.code_memory_mb=256"])
    fn = rewards.from_config(cfg.rewards, task_reward="code")
    assert fn.partial and fn.memory_mb == 256
    with pytest.raises(ConfigError, match="rewards.code_memory_mb=8"):
        apply_overrides(RunConfig(), ["rewards.code_memory_mb=8"])


def test_memory_limits_above_the_workers_own_work():
    # A program's process is forked from a sandbox worker, whose own address-space limit
    # (2 GiB over its size) it cannot raise without CAP_SYS_RESOURCE.
    fn = rewards.get("code", scale="01", timeout_s=TIMEOUT_S, workers=1, memory_mb=4096)
    prog = "import resource\ndef f(n):\n    return resource.getrlimit(resource.RLIMIT_AS)[1]"
    assert fn(prog, json.dumps({"entry_point": "f", "tests": [f"assert f(0) == {4096 << 20}"]}))
    assert fn.last_outcomes == ["pass"]


def test_code_knobs_keep_run_ids():
    from rl_jax.config import load_recipe, run_id

    # The shipped recipes' pinned ids (tests/test_loss_defaults.py), the code verifier's
    # knobs at their defaults.
    assert run_id(load_recipe("scalerl", ["checkpoint.every=0"])) == "v26ce9d608e9fa"
    assert run_id(load_recipe("grpo", ["checkpoint.every=0"])) == "v236c08291d17c"
    a = load_recipe("scalerl")
    assert run_id(apply_overrides(a, ["rewards.code_partial=true"])) != run_id(a)


# ---- one layer at a time ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    from rl_jax.rewards import SandboxPool

    p = SandboxPool(workers=1, preload=("rl_jax.rewards._code",))
    yield p
    p.close()


def _run(pool, program: str, off: tuple[str, ...]) -> str:
    ans = _asserts(cases=((1, 2),))
    (res,) = pool.run(
        "rl_jax.rewards._code:code_score", [(program, ans, TIMEOUT_S, 512, off)], timeout_s=10
    )
    return res[2]


ALL = ("audit", "seccomp", "landlock", "netns")


def test_audit_hook_alone_refuses(pool, tmp_path):
    marker = tmp_path / "m"
    off = ("seccomp", "landlock", "netns")
    progs = [
        "import os\ndef f(n):\n    os.fork()\n    return n + 1",
        "import os\ndef f(n):\n    os.system('true')\n    return n + 1",
        "import socket\ndef f(n):\n    return n + 1",
        f"def f(n):\n    open({str(marker)!r}, 'w')\n    return n + 1",
        "def f(n):\n    open('/etc/hostname').read()\n    return n + 1",
        "import ctypes\ndef f(n):\n    return n + 1",
        "import os\ndef f(n):\n    os.kill(os.getppid(), 0)\n    return n + 1",
    ]
    assert [_run(pool, p, off) for p in progs] == ["refused"] * len(progs)
    assert not marker.exists()


def test_the_audit_hook_reads_no_globals(tmp_path):
    """The hook and the functions it calls bind their policy and builtins as default
    arguments: a program that rebinds the module's names changes nothing they read."""
    import dis

    from rl_jax.rewards import _code_child

    hook, _ = _code_child.make_hook(str(tmp_path), ["/usr"], 3)
    called = [hook, *(d for d in hook.__defaults__ if callable(d) and hasattr(d, "__code__"))]
    assert _code_child._file_reason in called and len(called) == 2
    for fn in called + [_code_child._normpath, _code_child._is_dir]:
        loads = [i.argval for i in dis.get_instructions(fn) if i.opname == "LOAD_GLOBAL"]
        assert not loads, (fn.__name__, loads)


@pytest.mark.skipif(not _code_jail.layers()["seccomp"], reason="no seccomp here")
def test_seccomp_alone_stops_processes_sockets_signals(pool):
    off = ("audit", "landlock", "netns")
    progs = [
        "import os\ndef f(n):\n    os.fork()\n    return n + 1",
        "import os\ndef f(n):\n    assert os.system('true') == 0\n    return n + 1",
        "import os\ndef f(n):\n    os.execv('/bin/true', ['true'])",
        "import socket\ndef f(n):\n    socket.socket()\n    return n + 1",
        "import os\ndef f(n):\n    os.kill(os.getppid(), 0)\n    return n + 1",
    ]
    assert [_run(pool, p, off) for p in progs] == ["fail"] * 5
    # what seccomp does not cover, it lets through (the other layers' job)
    assert _run(pool, "def f(n):\n    open('/etc/hostname').read()\n    return n + 1", off) == (
        "pass"
    )


@pytest.mark.skipif(not _code_jail.layers()["landlock"], reason="no Landlock here")
def test_landlock_alone_stops_files(pool, tmp_path):
    marker = tmp_path / "m"
    secret = tmp_path / "secret"
    secret.write_text("2")
    off = ("audit", "seccomp", "netns")
    progs = [
        f"def f(n):\n    return int(open({str(secret)!r}).read())",
        f"def f(n):\n    open({str(marker)!r}, 'w')\n    return n + 1",
        "def f(n):\n    open('/tmp/rl_jax_landlock_probe', 'w')\n    return n + 1",
        "import os\ndef f(n):\n    os.kill(os.getppid(), 0)\n    return n + 1",
    ]
    expect = ["fail", "fail", "fail", "fail" if _code_jail.landlock_abi() >= 6 else "pass"]
    assert [_run(pool, p, off) for p in progs] == expect
    assert not marker.exists() and not os.path.exists("/tmp/rl_jax_landlock_probe")
    assert _run(pool, "def f(n):\n    open('ok', 'w').write('x')\n    return n + 1", off) == "pass"


def test_group_kill_alone_leaves_no_process(pool, tmp_path):
    """With every other layer off, a grandchild forked by the program (detached into
    its own session) is gone when the call returns."""
    pid_file = tmp_path / "pid"
    prog = (
        "import os, time\ndef f(n):\n    pid = os.fork()\n    if pid == 0:\n"
        "        time.sleep(60)\n        os._exit(0)\n"
        f"    open({str(pid_file)!r}, 'w').write(str(pid))\n    return n + 1"
    )
    assert _run(pool, prog, ALL) == "pass"
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_child_killed_before_its_setsid_is_killed_and_reaped():
    import subprocess

    # A call whose deadline falls right at its start kills its child before the child's
    # setsid(), while it is still in this process's group rather than its own.
    p = subprocess.Popen(["sleep", "60"])
    r, w = os.pipe()
    try:
        _code_jail.Child(pid=p.pid, req=w, resp=r).kill()
        with pytest.raises(ProcessLookupError):  # killed, and reaped: no such process
            os.kill(p.pid, 0)
    finally:
        p.kill()
        p.wait()


def test_the_programs_process_starts_before_the_alarm():
    import subprocess
    import sys

    # An alarm inside spawn (between its fork and its return) would leave the child and its
    # pipes with no owner to kill and close them. Run apart: code_score forks, as a worker.
    script = (
        "import json, signal\n"
        "from rl_jax.rewards import _code, _code_jail\n"
        "armed, real = [], _code_jail.spawn\n"
        "def spawn(*a, **k):\n"
        "    armed.append(signal.getitimer(signal.ITIMER_REAL)[0] > 0)\n"
        "    return real(*a, **k)\n"
        "_code_jail.spawn = spawn\n"
        "ans = json.dumps({'entry_point': 'f', 'tests': ['assert f(1) == 2']})\n"
        "print(_code.code_score('def f(n):\\n    return n + 1', ans, 30.0, 512)[2], armed)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["pass", "[False]"], out.stdout + out.stderr
