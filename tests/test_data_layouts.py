"""Records in the layouts people have: field mapping, answer extraction, and one line at
load that counts every row read and every row dropped, with why (docs/data.md)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from rl_jax.cli import main
from rl_jax.config import DataConfig, load_recipe
from rl_jax.config.data import CODE_FORMATS, FILE_FORMATS
from rl_jax.data import PromptPipeline, build_task
from rl_jax.data._files import extract_answer
from rl_jax.knobs import ConfigError
from rl_jax.train.preflight import check_run_inputs

MAPPED = ("data.question_field=prompt", "data.answer_field=solution")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_solution_rows(n: int = 40) -> list[dict]:
    """`{"prompt", "solution"}` rows (solutions end in \\boxed{}), one duplicated and two
    whose solution has no answer to read."""
    rows = [
        {"prompt": f"What is {i} + {i}?", "solution": f"{i} + {i} = \\boxed{{{2 * i}}}"}
        for i in range(n)
    ]
    rows.append(dict(rows[3]))
    rows += [{"prompt": "What is x?", "solution": "It depends."}] * 2
    return rows


@pytest.fixture
def no_trainer(monkeypatch):
    import rl_jax.train.loop as loop

    def tripwire(*a, **k):
        raise AssertionError("bad input reached the trainer")

    monkeypatch.setattr(loop, "train", tripwire)


# Code layouts read tests, not answers (tests/test_code_layouts.py).
@pytest.mark.parametrize("fmt", [f for f in FILE_FORMATS if f not in CODE_FORMATS])
def test_a_prompt_solution_file_loads_under_every_format_with_the_mapping_knobs(tmp_path, fmt):
    f = write_jsonl(tmp_path / "ps.jsonl", prompt_solution_rows())
    cfg = DataConfig(
        source="file",
        path=str(f),
        format=fmt,
        question_field="prompt",
        answer_field="solution",
        answer_extract="boxed",
        val_size=4,
    )
    task = build_task(cfg)
    problems = [*task.train, *task.val]
    assert (len(task.train), len(task.val)) == (36, 4)
    assert sorted(int(p.answer) for p in problems) == [2 * i for i in range(40)]
    assert all(p.meta["question"] == f"What is {int(p.answer) // 2} + {int(p.answer) // 2}?"
               for p in problems)  # fmt: skip
    assert task.reward_name == "math"
    r = task.report
    assert (r.rows, r.train, r.val) == (43, 36, 4)
    assert r.dropped == {"duplicate": 1, "unparsable answer": 2, "too long": 0}
    # Into the prompt pipeline: every training problem once per epoch.
    pipe = PromptPipeline(task.train, batch_size=6, seed=0, process_index=0, process_count=1)
    seen = [p.id for _ in range(pipe.batches_per_epoch) for p in next(pipe)]
    assert sorted(seen) == sorted(p.id for p in task.train)


def test_auto_reads_the_common_field_names_of_other_layouts(tmp_path):
    f = write_jsonl(tmp_path / "ps.jsonl", prompt_solution_rows())
    task = build_task(DataConfig(source="file", path=str(f), val_size=4))
    assert task.reward_name == "math" and len(task.train) + len(task.val) == 40
    assert "question 'prompt', answer the last \\boxed{} in 'solution'" in task.report.layout
    gsm = [
        {"query": f"{i}+1?", "response": f"so {i + 1}\n#### {i + 1:,}"} for i in range(999, 1010)
    ]
    f = write_jsonl(tmp_path / "qr.jsonl", gsm)
    task = build_task(
        DataConfig(
            source="file", path=str(f), val_size=1, question_field="query", answer_field="response"
        )
    )
    assert task.reward_name == "numeric"
    assert sorted(p.answer for p in [*task.train, *task.val])[:2] == ["1000", "1001"]


def test_answer_extractions():
    assert extract_answer("gsm8k", "3 + 4 = 7\n#### 1,234") == "1234"
    assert extract_answer("gsm8k", "no marker") is None
    assert extract_answer("boxed", "a \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_answer("boxed", "\\boxed{ }") is None
    assert extract_answer("none", "  42 ") == "42" and extract_answer("none", " ") is None
    text = "Answer: 3. Final answer: 17."
    assert extract_answer("regex", text, r"answer: (\d+)") == "17"
    assert extract_answer("regex", text, r"\d+") == "17"  # no group: the whole match
    assert extract_answer("regex", text, r"answer is (\d+)") is None


def test_a_regex_reads_the_answer_and_sets_the_verifier_by_the_answers(tmp_path):
    rows = [{"question": f"{i}*2?", "answer": f"Twice {i} is {2 * i}."} for i in range(10)]
    f = write_jsonl(tmp_path / "r.jsonl", rows)
    cfg = DataConfig(source="file", path=str(f), val_size=2, answer_regex=r"is (\d+)\.$")
    task = build_task(cfg)
    assert cfg.extract == "regex" and task.reward_name == "numeric"
    assert sorted(int(p.answer) for p in [*task.train, *task.val]) == [2 * i for i in range(10)]


def test_the_load_line_counts_rows_read_and_dropped_and_why(tmp_path):
    # The GSM8K case of the issue: 40 rows and a duplicate became 39 problems, silently.
    gsm = [{"question": f"q{i}: 2+{i}?", "answer": f"#### {2 + i}"} for i in range(40)]
    f = write_jsonl(tmp_path / "gsm.jsonl", [*gsm, dict(gsm[0]), {"question": "q", "answer": ""}])
    cfg = load_recipe("grpo", ["data.source=file", f"data.path={f}", "data.val_size=4"])
    out = io.StringIO()
    check_run_inputs(cfg, out=out)
    line = next(x for x in out.getvalue().splitlines() if x.startswith("data: "))
    assert line == (
        f"data: 42 rows read (data.path={f}; gsm8k layout: question 'question', answer after "
        "the last '####' in 'answer'); 2 dropped (1 duplicate, 1 unparsable answer, 0 too "
        "long); 36 train + 4 validation problems"
    )
    # A validation file: the training problems it holds are dropped from training, counted.
    v = write_jsonl(tmp_path / "val.jsonl", gsm[:5])
    cfg = load_recipe("grpo", ["data.source=file", f"data.path={f}", f"data.val_path={v}"])
    out = io.StringIO()
    check_run_inputs(cfg, out=out)
    assert "47 rows read" in out.getvalue()
    assert (
        "7 dropped (1 duplicate, 1 unparsable answer, 0 too long, 5 also in validation); "
        "35 train + 5 validation" in out.getvalue()
    )


def test_prompts_over_an_explicit_limit_are_dropped_and_counted(tmp_path):
    rows = [{"question": "1+1?" + " pad" * (20 * (i % 2)), "answer": str(i)} for i in range(20)]
    f = write_jsonl(tmp_path / "long.jsonl", rows)
    base = ["data.source=file", f"data.path={f}", "data.val_size=4", "data.answer_instruction="]
    out = io.StringIO()
    check_run_inputs(load_recipe("grpo", [*base, "sampling.max_prompt_len=48"]), out=out)
    assert "10 dropped (0 duplicate, 0 unparsable answer, 10 too long)" in out.getvalue()
    # auto (0) fits the longest prompt instead: nothing dropped.
    out = io.StringIO()
    check_run_inputs(load_recipe("grpo", base), out=out)
    assert "0 dropped" in out.getvalue()


@pytest.mark.parametrize(
    "overrides, names",
    [
        # A field the records do not have: named, with the fields they have.
        (["data.question_field=query"], ["data.question_field='query'", "['prompt', 'solution']"]),
        (["data.answer_field=answer"], ["data.answer_field='answer'", "['prompt', 'solution']"]),
        # A layout's own field the records lack: named, with the knob to set.
        (["data.format=gsm8k"], ["'question'", "['prompt', 'solution']", "data.question_field"]),
        (["data.format=polaris", "data.question_field=prompt"], ["'answer'", "data.answer_field"]),
        # No answer readable in any row.
        ([*MAPPED, "data.answer_extract=gsm8k"], ["none of its 43 rows", "data.answer_extract"]),
        ([*MAPPED, "data.answer_regex=[unclosed"], ["data.answer_regex"]),
        (["data.answer_extract=regex"], ["data.answer_extract='regex' needs data.answer_regex"]),
    ],
)
def test_bad_field_knobs_exit_2_naming_them(capsys, tmp_path, no_trainer, overrides, names):
    f = write_jsonl(tmp_path / "ps.jsonl", prompt_solution_rows())
    argv = ["train", "grpo", "data.source=file", f"data.path={f}", *overrides]
    rc = main([*argv, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in names:
        assert n in err, err


def test_field_knobs_of_a_generated_source_are_refused():
    with pytest.raises(ConfigError, match=r"data.question_field='prompt' reads records"):
        DataConfig(source="arith", question_field="prompt")
