"""The grid driver with the real trainer: two tiny `rl-jax train` runs end to end."""

import textwrap

import pytest

from rl_jax.cli.grid import main as grid_main
from rl_jax.grid.state import GridState
from rl_jax.runs import read_jsonl

SPEC = """
from rl_jax.grid import Axis, Budget, GridSpec, ReportSpec

def grid():
    return GridSpec(
        name="real",
        recipe="isocompute",
        base={"eval.num_prompts": 8, "eval.k": 2, "data.val_size": 8, "data.train_size": 64,
              "data.prompts_per_batch": 8,
              "logging.tensorboard": False, "logging.progress": False},
        axes=(Axis.of("sampling.n", [2, 4], short="n"),),
        budget=Budget(amount=32),  # B_p = 8: M = 2 at n = 2, 1 at n = 4
        evals_per_run=1,
        report=ReportSpec(kind="compare", x="rollouts", n_boot=20),
    )
"""


@pytest.mark.slow
def test_real_trainer_runs_a_tiny_grid(tmp_path, capsys):
    spec = tmp_path / "real_grid.py"
    spec.write_text(textwrap.dedent(SPEC))
    out = tmp_path / "out"
    args = [str(spec), "--out", str(out), "--jobs", "2", "--poll", "0.2"]
    assert grid_main(args) == 0
    text = capsys.readouterr().out
    assert "WARNING" not in text  # the trainer resolved each run to the grid's run id
    st = GridState.load(out / "real", "real")
    assert [r.status for r in st.runs.values()] == ["done", "done"]
    rows = read_jsonl(out / "real" / "curves.jsonl")
    by_run = {}
    for r in rows:
        by_run.setdefault(r["run_name"], []).append(r)
    assert len(by_run) == 2
    for name, rs in by_run.items():
        n = rs[0]["sampling.n"]
        assert name.startswith(f"n{n}_s0-") and rs[-1]["rollouts"] == 32
        assert 0.0 <= rs[-1]["val/pass@1"] <= 1.0
    assert (out / "real" / "report.md").exists()
    # Rerunning finds both finished and starts nothing.
    assert grid_main([*args, "--no-report"]) == 0
    assert all(r.launches == 1 for r in GridState.load(out / "real", "real").runs.values())
