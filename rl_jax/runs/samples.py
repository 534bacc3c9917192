"""Completions one can read: a few (prompt, completion, reward, verdict) rows per logged
step in `<run>/samples.jsonl` (rewound with metrics.jsonl on resume), and their
readers `logged_rows(run_dir, step=..., rows=...)` and `format_samples` (`rl-jax samples RUN`).

A row: {"step", "problem_id", "sample", "prompt", "completion", "answer", "reward"
(shaped), "raw_reward" (the verifier's), "verdict"}. verdict is "correct", "wrong" (an
answer was read and differs) or "no answer" (the verifier found none to read).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rl_jax.knobs import ConfigError
from rl_jax.runs.atomic import read_jsonl
from rl_jax.runs.storage import join

SAMPLES_FILE = "samples.jsonl"


def verdict(raw_reward: float, well_formed: bool) -> str:
    if raw_reward > 0:
        return "correct"
    return "wrong" if well_formed else "no answer"


def sample_rows(
    *,
    step: int,
    problems: Sequence[Any],
    completions: Sequence[str],
    raw: Sequence[float],
    shaped: Sequence[float],
    group_size: int,
    rows: int,
    well_formed=None,
) -> list[dict[str, Any]]:
    """One row for each of the first `rows` prompts: its first completion (rows are
    grouped by prompt, `group_size` each). well_formed: `fn(text) -> bool` of the verifier."""
    out = []
    for g in range(min(rows, len(problems))):
        b = g * group_size
        text = completions[b]
        ok = bool(well_formed(text)) if well_formed is not None else False
        p = problems[g]
        out.append(
            {
                "step": int(step),
                "problem_id": int(p.id),
                "sample": 0,
                "prompt": p.prompt,
                "completion": text,
                "answer": p.answer,
                "reward": float(shaped[b]),
                "raw_reward": float(raw[b]),
                "verdict": verdict(float(raw[b]), ok),
            }
        )
    return out


def format_row(r: dict[str, Any]) -> str:
    """One sample as text (also the TensorBoard text of a row)."""
    return (
        f"--- step {r.get('step')}  problem {r.get('problem_id')}  reward "
        f"{float(r.get('reward', 0.0)):+.3f}  {r.get('verdict', '?')} (answer: "
        f"{r.get('answer', '')})\n"
        f"[prompt]\n{r.get('prompt', '')}\n[completion]\n{r.get('completion', '')}\n"
    )


def logged_rows(run_dir: str | Path, *, step: int | None = None, rows: int = 0) -> list[dict]:
    """The rows `<run_dir>/samples.jsonl` holds for `step` (None: the newest logged step),
    the first `rows` of them (0: all). A step that logged none, a line that is not a JSON
    row (but a torn last one) and a row without an integer step or with a reward that is not
    a number are ConfigErrors naming the steps that did or the file."""
    path = join(run_dir, SAMPLES_FILE)
    try:
        logged = read_jsonl(path)
    except ValueError as e:
        raise ConfigError(f"{e}: {SAMPLES_FILE} is damaged") from None
    for n, r in enumerate(logged, 1):
        if type(r.get("step")) is not int:
            raise ConfigError(
                f"{path}: row {n} has step={r.get('step')!r}, not an integer step:"
                f" {SAMPLES_FILE} is damaged"
            )
        reward = r.get("reward", 0.0)
        if type(reward) not in (int, float):
            raise ConfigError(
                f"{path}: row {n} has reward={reward!r}, not a number: {SAMPLES_FILE} is damaged"
            )
    if not logged:
        raise ConfigError(f"no samples in {path} (logging.samples_every=0, or no step logged yet)")
    steps = sorted({int(r["step"]) for r in logged})
    want = steps[-1] if step is None else step
    if want not in steps:
        shown = steps if len(steps) <= 12 else [*steps[:6], "...", *steps[-5:]]
        raise ConfigError(
            f"--step {want}: {path} has no rows of that step; logged steps: "
            + ", ".join(str(s) for s in shown)
        )
    out = [r for r in logged if int(r["step"]) == want]
    return out[:rows] if rows > 0 else out


def format_samples(run_dir: str | Path, *, step: int | None = None, rows: int = 0) -> str:
    """`logged_rows(run_dir, step=step, rows=rows)` as text."""
    return "\n".join(format_row(r) for r in logged_rows(run_dir, step=step, rows=rows))


def samples_due(every: int, *, step: int, eval_every: int, last_step: int) -> bool:
    """Whether step `step` logs samples: every `every` steps (logging.samples_every; -1 =
    at each evaluation, eval.every, and the last step; 0 = never)."""
    if every == 0:
        return False
    if every < 0:
        every = eval_every
    return step == last_step or (every > 0 and step % every == 0)
