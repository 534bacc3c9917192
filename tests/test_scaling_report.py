"""Curve rows in (JSON lines, CSV, parquet, run dirs), fits/report/plots out, the CLI, no JAX."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.cli.fit import main
from rl_jax.scaling import (
    CurveError,
    FitError,
    FrontierError,
    curves_from_rows,
    fit_runs,
    load_rows,
    write_report,
)
from rl_jax.scaling.synthetic import curve_rows, synthetic_curve

ROOT = Path(__file__).resolve().parents[1]


def _recipe_rows(seed=0, recipes=(("scalerl", 0.65, 2.0, 2), ("dapo", 0.58, 1.7, 1))):
    rng = np.random.default_rng(seed)
    rows = []
    for name, a, b, seeds in recipes:
        for s in range(seeds):
            x, y = synthetic_curve(
                rng, r0=0.25, a=a, b=b, c_mid=2e14, c_max=3e15, n_points=24, noise=0.01
            )
            knobs = {"loss.name": name, "sampling.n": 8, "data.prompts_per_batch": 8}
            rows += curve_rows(f"{name}-{s}", x, y, recipe=name, knobs=knobs)
    return rows


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ----------------------------------------------------------------------------- reading


def test_load_rows_formats_and_flattening(tmp_path):
    rows = _recipe_rows()[:5]
    nested = [dict(r, knobs={"sampling": {"n": 8}, "loss.eps": 5}) for r in rows]
    p = tmp_path / "a.jsonl"
    _write_jsonl(p, nested)
    with open(p, "a") as f:
        f.write('{"run_id": "torn", "ste')  # a killed writer's last line
    got = load_rows(p)
    assert len(got) == 5 and got[0]["sampling.n"] == 8 and got[0]["loss.eps"] == 5
    assert got[0]["_source"] == str(p)

    csv_path = tmp_path / "b.csv"
    csv_path.write_text("run_id,step,flops,val/pass@1\nr,0,0,0.2\nr,1,10,\nr,2,20,nan\n")
    got = load_rows(csv_path)
    assert got[0] == {
        "run_id": "r",
        "step": 0,
        "flops": 0,
        "val/pass@1": 0.2,
        "_source": str(csv_path),
    }
    assert "val/pass@1" not in got[1]  # a blank cell is absent, not NaN
    (c,) = curves_from_rows(got)  # absent: skipped quietly; NaN: dropped and flagged
    assert c.x.tolist() == [0.0] and not c.reliable and "dropped 1 row" in c.warnings[0]
    assert math.isnan(got[2]["val/pass@1"])

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq_path = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist(rows), pq_path)
    assert [r["val/pass@1"] for r in load_rows(pq_path)] == [r["val/pass@1"] for r in rows]

    run_dir = tmp_path / "runs" / "exp1"
    _write_jsonl(run_dir / "curve.jsonl", rows)
    (run_dir / "plots").mkdir()
    _write_jsonl(run_dir / "metrics.jsonl", [{"step": 0, "loss": 1.0}])  # not a curve file
    assert len(load_rows(tmp_path / "runs")) == 5

    with pytest.raises(CurveError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(CurveError, match="unknown file type"):
        load_rows(tmp_path / "d.txt")
    with pytest.raises(CurveError, match="without any curve.jsonl"):
        load_rows(tmp_path / "runs" / "exp1" / "plots")


def test_csv_with_a_byte_order_mark_keeps_its_first_column(tmp_path):
    """A spreadsheet's CSV starts with a BOM; its first header is still `run_id`, so two runs
    stay two (they were merged into one run named after the file, step by step)."""
    lines = ["run_id,step,flops,val/pass@1"]
    lines += [
        f"{r},{i},{i}e15,{0.1 * (i + 1) + d:.2f}"
        for r, d in (("a", 0), ("b", 0.05))
        for i in range(6)
    ]
    p = tmp_path / "curves.csv"
    p.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    rows = load_rows(p)
    assert rows[0]["run_id"] == "a"
    assert [c.run_id for c in curves_from_rows(rows, group_by=None)] == ["a", "b"]


def test_curves_from_rows_groups_sorts_and_checks():
    rows = _recipe_rows()
    rows = rows[::-1]  # arrival order must not matter: sorted by step
    curves = curves_from_rows(rows)
    assert sorted(c.run_id for c in curves) == ["dapo-0", "scalerl-0", "scalerl-1"]
    assert {c.run_id: c.group for c in curves}["scalerl-1"] == "scalerl"
    for c in curves:
        assert np.all(np.diff(c.x) > 0) and c.steps[0] == 0 and c.reliable
    # No recipe column (or an empty one): each run is its own group.
    plain = [dict(r, recipe="") for r in rows]
    assert {c.group for c in curves_from_rows(plain)} == {"dapo-0", "scalerl-0", "scalerl-1"}
    # Any column may be x or metric; a train-only row (no metric) is skipped.
    rows2 = [dict(r, gpu_hours=r["flops"] / 1e12) for r in rows] + [{"run_id": "dapo-0", "step": 5}]
    c2 = curves_from_rows(rows2, x="gpu_hours", metric="val/pass@1", group_by=None)
    assert len(c2) == 3 and all(c.group == c.run_id for c in c2)


def test_curve_row_problems_are_clear():
    rows = _recipe_rows(recipes=(("r", 0.6, 2.0, 1),))
    with pytest.raises(CurveError, match=r"no metric.*'val/pass@2'.*did you mean.*val/pass@1"):
        curves_from_rows(rows, metric="val/pass@2")
    with pytest.raises(CurveError, match="no compute"):
        curves_from_rows(rows, x="gpu_hours")
    bad = [dict(r) for r in rows]
    bad[7]["flops"] = bad[6]["flops"] * 0.5
    with pytest.raises(
        CurveError, match=r"run r-0: compute 'flops' is not increasing \(step 60 -> 70"
    ):
        curves_from_rows(bad)
    dup = rows + [dict(rows[3])]
    c = curves_from_rows(dup)[0]
    assert c.x.size == len(rows) and any("repeated step" in w for w in c.warnings)
    clash = rows + [dict(rows[3], flops=123.0)]
    with pytest.raises(CurveError, match="appears twice"):
        curves_from_rows(clash)
    nan_rows = [dict(r) for r in rows]
    nan_rows[4]["val/pass@1"] = float("nan")
    nan_rows[9]["flops"] = None
    c = curves_from_rows(nan_rows)[0]
    assert c.x.size == len(rows) - 2 and not c.reliable
    assert "dropped 2 row(s)" in c.warnings[0]
    with pytest.raises(CurveError, match="no curve rows"):
        curves_from_rows([])


# ----------------------------------------------------------------------------- fit_runs / report


def test_fit_runs_entries_ranking_and_flags():
    rows = _recipe_rows()
    nan_run = curve_rows("broken-0", [0, 1e14, 2e14], [0.2, float("nan"), 0.3], recipe="broken")
    short = curve_rows("short-0", [0, 1e14, 2e14], [0.2, 0.25, 0.3], recipe="short")
    rep = fit_runs(rows + nan_run + short, method="lsq", n_boot=50, extrapolate=0.5)
    by = {(e.kind, e.name): e for e in rep.entries}
    assert set(by) == {
        ("run", "scalerl-0"),
        ("run", "scalerl-1"),
        ("recipe", "scalerl"),
        ("run", "dapo-0"),
        ("run", "broken-0"),
        ("run", "short-0"),
    }
    pooled = by[("recipe", "scalerl")]
    assert pooled.fit.n_points == 2 * 24 and pooled.boot.kind == "runs+residual"
    assert pooled.rank == 1 and by[("run", "dapo-0")].rank == 2
    assert [r["recipe"] for r in rep.table] == ["scalerl", "dapo"]
    # Failed fits carry an error and no numbers; the NaN run is not silently trusted.
    for name in ("broken-0", "short-0"):
        e = by[("run", name)]
        assert e.fit is None and "free parameters" in e.error and not e.reliable
        js = e.to_json(x="flops", metric="val/pass@1")
        assert js["A"] is None and js["A_interval"] is None and js["error"]
    assert any("dropped 1 row" in w for w in by[("run", "broken-0")].warnings)
    ext = by[("run", "dapo-0")].extrapolation
    assert ext is not None and ext.fraction == 0.5
    assert rep.early is not None and rep.early.leader == "scalerl"
    assert rep.frontier is None and "sampling.n" in rep.frontier_note
    with pytest.raises(FrontierError):
        fit_runs(rows, method="lsq", n_boot=50, extrapolate=None, frontier="on")


def test_nan_rows_make_a_fit_unreliable():
    rows = _recipe_rows(recipes=(("r", 0.6, 2.0, 1),))
    rows[5]["val/pass@1"] = float("nan")
    rep = fit_runs(rows, method="lsq", n_boot=40, extrapolate=None)
    (e,) = rep.entries
    assert e.fit is not None and e.fit.reliable  # the curve itself fits fine...
    assert not e.reliable  # ...but a run with NaN evaluations is not trusted
    assert e.to_json(x="flops", metric="val/pass@1")["reliable"] is False


def test_fit_start_percentage():
    rows = _recipe_rows(recipes=(("r", 0.6, 2.0, 1),))
    rep = fit_runs(rows, method="lsq", n_boot=40, extrapolate=None, fit_start="10%")
    (e,) = rep.entries
    assert e.fit.options.fit_start == pytest.approx(0.1 * 3e15)
    assert e.fit.x.min() >= 0.1 * 3e15
    with pytest.raises(FitError, match="percentage"):
        fit_runs(rows, method="lsq", n_boot=40, fit_start="150%")
    with pytest.raises(FitError, match="unknown fit option"):
        fit_runs(rows, mehtod="lsq")


def test_write_report_files(tmp_path):
    rep = fit_runs(_recipe_rows(), method="lsq", n_boot=40, extrapolate=0.5)
    written = write_report(rep, tmp_path)
    names = {p.relative_to(tmp_path).as_posix() for p in written}
    assert {"fits.json", "report.md", "recipes.csv", "recipes.md", "early_decision.json"} <= names
    assert {"plots/curves.png", "plots/curves.svg", "plots/extrapolation_dapo-0.png"} <= names
    fits = json.loads((tmp_path / "fits.json").read_text())
    assert isinstance(fits, list) and len(fits) == 4
    for obj in fits:
        for k in ("run_id", "R0", "A", "B", "C_mid", "A_interval", "B_interval", "C_mid_interval"):
            assert k in obj
        lo, hi = obj["A_interval"]
        assert lo <= obj["A"] <= hi
    png = (tmp_path / "plots" / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in (tmp_path / "plots" / "curves.svg").read_bytes()[:2000]
    md = (tmp_path / "report.md").read_text()
    for section in ("## Recipes", "## Fits", "## Extrapolation checks", "## Early decision"):
        assert section in md
    assert "![curves](plots/curves.png)" in md
    csv_lines = (tmp_path / "recipes.csv").read_text().splitlines()
    assert csv_lines[1].startswith("1,scalerl,2,48,")


def test_hostile_names_keep_the_markdown_tables_whole(tmp_path):
    """A recipe or run name with '|' or a line break is one cell of its row, not extra
    columns or a row cut in two."""
    hostile = (("a|b", 0.65, 2.0, 1), ("new\nline", 0.58, 1.7, 1))
    rep = fit_runs(_recipe_rows(recipes=hostile), method="lsq", n_boot=40, extrapolate=0.5)
    write_report(rep, tmp_path, plots=False)
    for name in ("recipes.md", "report.md"):
        for line in (tmp_path / name).read_text().splitlines():
            if line.startswith("|"):
                cells = line.replace("\\|", "").count("|")
                assert cells in (13, 11, 8, 19), line  # the column count of one of its tables
            else:
                assert not line.startswith("line"), line
    md = (tmp_path / "recipes.md").read_text()
    assert "| a\\|b |" in md and "| new line |" in md


def test_plot_files_of_two_runs_never_collide_and_long_names_fit(tmp_path):
    """Run ids that differ only in characters a file name cannot hold ('a|b', 'a b') had
    one extrapolation plot between them (the second overwrote the first, and the report
    showed it for both); a 300-character id raised OSError (file name too long)."""
    names = (("a|b", 0.65, 2.0, 1), ("a b", 0.58, 1.7, 1), ("r" * 300, 0.6, 1.8, 1))
    rep = fit_runs(_recipe_rows(recipes=names), method="lsq", n_boot=40, extrapolate=0.5)
    written = write_report(rep, tmp_path)
    plots = [p for p in written if p.name.startswith("extrapolation_") and p.suffix == ".png"]
    assert len(set(plots)) == 3 and all(p.exists() and len(p.name) < 120 for p in plots)
    md = (tmp_path / "report.md").read_text()
    assert len({p.name for p in plots if p.name in md}) == 3


# ----------------------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path, capsys):
    _write_jsonl(tmp_path / "curves.jsonl", _recipe_rows())
    out = tmp_path / "out"
    rc = main([str(tmp_path / "curves.jsonl"), "--out", str(out), "--n-boot", "40", "--no-plots"])
    assert rc == 0
    assert "fitted 4 of 4" in capsys.readouterr().out
    fits = json.loads((out / "fits.json").read_text())
    assert {f["run_id"] for f in fits} == {"scalerl-0", "scalerl-1", "scalerl", "dapo-0"}
    assert all(f["method"] == "grid" for f in fits)  # the paper's procedure by default
    assert not (out / "plots").exists()


def test_cli_errors(tmp_path, capsys):
    _write_jsonl(tmp_path / "c.jsonl", _recipe_rows(recipes=(("r", 0.6, 2.0, 1),)))
    args = [str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), "--no-plots", "--n-boot", "40"]
    assert main(args + ["--metric", "val/best@k"]) == 2
    assert "no metric (--metric) column 'val/best@k'" in capsys.readouterr().err
    assert main(args + ["--frontier", "on"]) == 2
    assert "sampling.n" in capsys.readouterr().err
    # Curves none of which can be fitted are unusable input: one line naming the file and
    # the reason, nothing written (a one-point curve, a three-point one).
    for points in ([0], [0, 1, 2]):
        short = tmp_path / f"short{len(points)}.jsonl"
        _write_jsonl(short, curve_rows("s", points, [0.1, 0.2, 0.3][: len(points)]))
        assert main([str(short), "--out", str(tmp_path / "o2")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(short) in err and "free parameters" in err, err
        assert not (tmp_path / "o2").exists()
    # One curve too short among fitted ones is named and left out; the rest is written.
    assert main([str(tmp_path / "c.jsonl"), str(short), "--out", str(tmp_path / "o3")]) == 0
    assert "s: " in capsys.readouterr().err and (tmp_path / "o3" / "fits.json").is_file()
    # A file that is not UTF-8 (or not a curve file at all) is named, and nothing written.
    for name, data in (("latin1.jsonl", b'{"run_id": "caf\xe9"}\n'), ("x.parquet", b"junk")):
        (tmp_path / name).write_bytes(data)
        assert main([str(tmp_path / name), "--out", str(tmp_path / "o4")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(tmp_path / name) in err, err
        assert not (tmp_path / "o4").exists()
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    assert main([str(tmp_path / "list.jsonl"), "--out", str(tmp_path / "o4")]) == 2
    assert "line 1 is a JSON list, not an object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--method", "newton"])


def test_cli_runs_without_jax(tmp_path):
    """The fitting library, its plots and its CLI never import JAX (an analyst's laptop)."""
    rows = _recipe_rows(recipes=(("a", 0.6, 2.0, 1), ("b", 0.5, 1.5, 1)))
    _write_jsonl(tmp_path / "c.jsonl", rows)
    code = (
        "import sys\n"
        "import rl_jax.scaling\n"
        "assert 'jax' not in sys.modules\n"
        "from rl_jax.cli.fit import main\n"
        f"rc = main([{str(tmp_path / 'c.jsonl')!r}, '--out', {str(tmp_path / 'o')!r}, "
        "'--n-boot', '30', '--method', 'lsq', '--extrapolate', '0.5'])\n"
        "assert rc == 0, rc\n"
        "heavy = ('jax', 'flax', 'optax')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "assert not bad, bad\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MPLBACKEND"] = "TkAgg"  # the library must not depend on the default backend
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "o" / "plots" / "curves.png").exists()


@pytest.mark.parametrize("flag, values", [("--a-grid", "nan,0.5"), ("--c-mid-grid", "nan,1e12")])
def test_cli_refuses_a_grid_with_a_value_that_is_not_finite(tmp_path, capsys, flag, values):
    # A NaN in the A grid was fitted around silently; one in the C_mid grid failed as
    # "All-NaN slice encountered", naming neither the flag nor the value.
    _write_jsonl(tmp_path / "c.jsonl", _recipe_rows())
    out = tmp_path / "o"
    assert main([str(tmp_path / "c.jsonl"), "--out", str(out), flag, values]) == 2
    err = capsys.readouterr().err.strip()
    name = flag[2:].replace("-", "_")
    assert len(err.splitlines()) == 1 and f"{name}=(nan" in err and "finite" in err, err
    assert not out.exists()


@pytest.mark.parametrize("fit_start", ["nan", "inf", "nan%"])
def test_cli_refuses_a_fit_start_that_is_not_finite(tmp_path, capsys, fit_start):
    # A NaN fit_start left every run no point to fit, said as too few evaluations per run.
    _write_jsonl(tmp_path / "c.jsonl", _recipe_rows())
    out = tmp_path / "o"
    assert main([str(tmp_path / "c.jsonl"), "--out", str(out), "--fit-start", fit_start]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"fit_start={fit_start!r} must be a finite" in err, err
    assert not out.exists()


def test_cli_negative_seed_is_refused_naming_the_flag(tmp_path, capsys):
    # numpy refused it as "expected non-negative integer", naming no flag.
    _write_jsonl(tmp_path / "c.jsonl", _recipe_rows())
    assert main([str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "o"), "--seed=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--seed=-1" in err, err
