"""Per-task fits of a mixture's curves (val/<task>/pass@1): rl_jax.scaling.fit_tasks,
`rl-jax fit --per-task`, and the grid report's per-task section. The curves are ScaleRL's
math + code fits (Table 1: math A 0.595, B 2.05, C_mid 2896; code A 0.615, B 1.09,
C_mid 1675), sampled with a little noise."""

import json
from pathlib import Path

import numpy as np
import pytest

from rl_jax import scaling
from rl_jax.cli.fit import main

TASKS = {"math": (0.595, 2.05, 2896.0), "code": (0.615, 1.09, 1675.0)}
R0 = 0.3


def sig(c, a, b, c_mid):
    return R0 + (a - R0) / (1 + (c_mid / c) ** b)


def mixture_rows(run_id="mix", seed=0):
    rng = np.random.default_rng(seed)
    xs = np.geomspace(100, 40000, 25)
    rows = [{"run_id": run_id, "recipe": "mix", "step": 0, "gpu_hours": 0.0,
             "val/pass@1": R0, "val/math/pass@1": R0, "val/code/pass@1": R0}]  # fmt: skip
    for i, x in enumerate(xs, 1):
        per = {t: sig(x, *p) + rng.normal(0, 0.002) for t, p in TASKS.items()}
        rows.append(
            {
                "run_id": run_id,
                "recipe": "mix",
                "step": i,
                "gpu_hours": float(x),
                "val/pass@1": float(np.mean(list(per.values()))),
                **{f"val/{t}/pass@1": float(v) for t, v in per.items()},
                "val/code/best@k": 1.0,  # another metric of a task: not a task of its own
            }
        )
    return rows


def test_task_metrics_finds_each_tasks_column():
    rows = mixture_rows()
    assert scaling.task_metrics(rows) == {"math": "val/math/pass@1", "code": "val/code/pass@1"}
    assert scaling.task_metrics(rows, "val/best@k") == {"code": "val/code/best@k"}
    assert scaling.task_metrics([{"val/pass@1": 1.0, "val/pass@1/2": 0.5}]) == {}


def test_fit_tasks_recovers_each_tasks_curve():
    fits = scaling.fit_tasks(mixture_rows(), x="gpu_hours", n_boot=20, extrapolate=None)
    assert list(fits) == ["math", "code"]
    for task, (a, b, c_mid) in TASKS.items():
        (entry,) = [e for e in fits[task].entries if e.kind == "run"]
        f = entry.fit
        assert f.A == pytest.approx(a, abs=0.02), task
        assert f.B == pytest.approx(b, rel=0.25), task
        assert f.C_mid == pytest.approx(c_mid, rel=0.35), task
    table = scaling.task_table(fits)
    assert {r["task"] for r in table} == {"math", "code"} and all("A" in r for r in table)


def test_fit_cli_fits_each_task(tmp_path, capsys):
    f = tmp_path / "curve.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in mixture_rows()))
    out = tmp_path / "fits"
    args = [str(f), "--x", "gpu_hours", "--out", str(out), "--n-boot", "20", "--no-plots"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "task math: mix" in text and "task code: mix" in text and "and 2 tasks" in text
    rows = json.loads((out / "tasks.json").read_text())
    got = {(r["task"], r["kind"]): r["A"] for r in rows}
    assert got[("math", "run")] == pytest.approx(0.595, abs=0.02)
    assert got[("code", "run")] == pytest.approx(0.615, abs=0.02)
    assert (out / "tasks" / "code" / "report.md").exists()
    assert "| code | mix |" in (out / "tasks.md").read_text()
    # one task's column as the metric; and the per-task fits off
    base = [str(f), "--x", "gpu_hours", "--n-boot", "20", "--no-plots", "--out"]
    assert main([*base, str(tmp_path / "one"), "--metric", "val/code/pass@1"]) == 0
    assert main([*base, str(tmp_path / "off"), "--per-task", "off"]) == 0
    assert not (tmp_path / "off" / "tasks.md").exists()


def test_grid_report_has_per_task_fits(tmp_path):
    from rl_jax.grid import Axis, GridSpec, ReportSpec, expand
    from rl_jax.grid.driver import run_dir
    from rl_jax.grid.results import write_report

    spec = GridSpec(
        name="mix",
        recipe="code_mix_cpu",
        axes=(Axis.of("train.lr", [1e-5, 2e-5], short="lr"),),
        report=ReportSpec(x="gpu_hours", n_boot=20),
    )
    plans = expand(spec)
    for i, p in enumerate(plans):
        d = Path(run_dir(str(tmp_path / "runs"), p))
        d.mkdir(parents=True)
        rows = mixture_rows(run_id=p.run_id, seed=i)
        (d / "curve.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = Path(write_report(spec, plans, tmp_path)).read_text()
    assert "## Per-task fits" in md and "| math |" in md and "| code |" in md
    assert (tmp_path / "fits" / "all" / "tasks" / "math" / "report.md").exists()
