"""Code problems: the generated task (data.source=code) and the test layouts of code-RL
files (code, mbpp, humaneval, apps, livecodebench), read by name, by their fields or by
field mapping, into answers the code verifier runs."""

import json

import pytest

from rl_jax import rewards
from rl_jax.config import DataConfig
from rl_jax.data import build_task
from rl_jax.data._code_tasks import FAMILIES
from rl_jax.knobs import ConfigError
from rl_jax.rewards._code import CodeTests


@pytest.fixture(scope="module")
def code():
    return rewards.get("code", scale="01", timeout_s=5.0, workers=2)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_generated_task_references_pass_their_tests(code):
    for d in (1, 2, 3):
        task = build_task(DataConfig(source="code", difficulty=d, train_size=40, val_size=8))
        assert task.reward_name == "code" and (len(task.train), len(task.val)) == (40, 8)
        assert {p.id for p in task.train}.isdisjoint(p.id for p in task.val)
        probs = [*task.train[:10], *task.val[:4]]
        assert all(CodeTests.parse(p.answer).total == 4 for p in probs)
        got = code.batch([p.meta["reference"] for p in probs], [p.answer for p in probs])
        assert got.tolist() == [1.0] * len(probs), code.last_outcomes
        # a wrong program fails them
        assert (
            code(probs[0].meta["reference"].replace("return", "return 1 +"), probs[0].answer) == 0
        )
    every = {f.name for fams in FAMILIES.values() for f in fams}
    assert len(every) == 20


def test_generated_task_is_seeded_and_sized():
    a = build_task(DataConfig(source="code", difficulty=1, train_size=30, val_size=5, seed=1))
    b = build_task(DataConfig(source="code", difficulty=1, train_size=60, val_size=5, seed=1))
    assert [p.id for p in a.val] == [p.id for p in b.val]  # validation stays put
    with pytest.raises(ConfigError, match="has 6991 distinct problems"):
        build_task(DataConfig(source="code", difficulty=1, train_size=7000, val_size=5))
    with pytest.raises(ConfigError, match=r"data.difficulty=4 must be in \[1, 3\]"):
        DataConfig(source="code", difficulty=4)


ROWS = {
    "mbpp": {
        "text": "Write a function to add one.",
        "code": "def add_one(n):\n    return n + 1",
        "test_list": ["assert add_one(1) == 2", "assert add_one(4) == 5"],
        "test_setup_code": "",
    },
    "humaneval": {
        "task_id": "HumanEval/0",
        "prompt": 'def add_one(n):\n    """n plus one"""\n',
        "canonical_solution": "    return n + 1\n",
        "test": "def check(candidate):\n    assert candidate(1) == 2\n",
        "entry_point": "add_one",
    },
    "apps": {
        "question": "Read two numbers, print their sum.",
        "input_output": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}),
        "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)"]),
        "starter_code": "",
    },
    "apps_call": {
        "question": "Return x plus one.",
        "input_output": json.dumps({"fn_name": "inc", "inputs": [[1], [5]], "outputs": [[2], [6]]}),
        "starter_code": "class Solution:\n    def inc(self, x):\n",
    },
    "livecodebench": {
        "question_content": "Return the sum of nums.",
        "public_test_cases": json.dumps(
            [{"input": "[1, 2]", "output": "3", "testtype": "functional"}]
        ),
        "metadata": json.dumps({"func_name": "total"}),
        "starter_code": "class Solution:\n    def total(self, nums): ...",
    },
    "code": {"prompt": "Write add_one(n).", "tests": ["assert add_one(2) == 3"]},
}
SOLUTIONS = {
    "mbpp": "def add_one(n):\n    return n + 1",
    "humaneval": "    return n + 1\n",  # continues the prompt
    "apps": "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "apps_call": "class Solution:\n    def inc(self, x):\n        return x + 1",
    "livecodebench": "class Solution:\n    def total(self, nums):\n        return sum(nums)",
    "code": "def add_one(n):\n    return n + 1",
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_layouts_by_name_and_by_fields(tmp_path, code, name):
    fmt = "apps" if name == "apps_call" else name
    row = ROWS[name]
    q = next(k for k in ("text", "question", "question_content", "prompt") if k in row)
    # a second problem (another question) for the training split; HumanEval's prompt is code
    other = {**row, "task_id": "x"} if name == "humaneval" else {**row, q: row[q] + " Again."}
    if name == "humaneval":
        other["prompt"] = row["prompt"].replace("n plus one", "one more than n")
    f = _write(tmp_path / "d.jsonl", [row, other])
    for given in ("auto", fmt):
        task = build_task(DataConfig(source="file", path=f, format=given, val_size=1))
        assert task.reward_name == "code"
        (p,) = task.val
        assert code(SOLUTIONS[name], p.answer) == 1.0, (name, p.answer, code.last_outcomes)
        assert code("def nothing():\n    pass", p.answer) == 0.0
    if name in ("mbpp", "humaneval", "apps"):
        ref = p.meta["reference"]
        assert code(ref, p.answer) == 1.0


def test_field_mapping_and_what_a_tests_field_may_hold(tmp_path, code):
    rows = [
        {"q": "a", "checks": ["assert f(1) == 1"]},
        {"q": "b", "checks": "assert f(2) == 2\nassert f(3) == 3"},
        {
            "q": "c",
            "checks": "def check(candidate):\n    assert candidate(4) == 4",
            "entry_point": "f",
        },
        {"q": "d", "checks": json.dumps({"inputs": [[5]], "outputs": [5]}), "entry_point": "f"},
        {"q": "e", "checks": "no tests here"},
        {"q": "g", "checks": "def check(candidate):\n    pass"},  # check() of what? dropped
        {"q": "f", "checks": []},
    ]
    f = _write(tmp_path / "m.jsonl", rows)
    cfg = DataConfig(
        source="file",
        path=f,
        format="code",
        question_field="q",
        answer_field="checks",
        val_size=1,
    )
    task = build_task(cfg)
    assert task.report.dropped["unparsable answer"] == 3
    probs = [*task.train, *task.val]
    assert len(probs) == 4
    ok = code.batch(["def f(n):\n    return n"] * 4, [p.answer for p in probs])
    assert ok.tolist() == [1.0] * 4
    with pytest.raises(ConfigError, match="reads tests, not an answer"):
        build_task(DataConfig(**{**vars(cfg), "answer_extract": "boxed"}))
    with pytest.raises(ConfigError, match="data.answer_field='nope' is not a field"):
        build_task(DataConfig(source="file", path=f, format="code", answer_field="nope"))


def test_warm_up_rows_hold_the_reference_program_whole():
    from rl_jax.data import CharTokenizer
    from rl_jax.train.sft import sft_arrays, sft_length, target_text

    tok = CharTokenizer()
    code = build_task(DataConfig(source="code", difficulty=1, train_size=8, val_size=1)).train
    countdown = build_task(DataConfig(source="countdown", train_size=8, val_size=1)).train
    for problems in (code, countdown):
        length = sft_length(tok, problems)
        arr = sft_arrays(tok, problems, length)
        for p, mask in zip(problems, arr["mask"], strict=True):
            # every token of the target and the EOS is trained on (none cut at 16 tokens)
            assert mask.sum() == len(tok.encode(target_text(p))) + 1
    assert target_text(code[0]).startswith("def ") and "\ufffd" not in tok.decode(
        tok.encode(target_text(code[0]))
    )
