"""Iso-compute analysis: record-breaking points, frontier, n*(C), sensitivity."""

import json

import numpy as np
import pytest

from rl_jax.scaling import (
    Curve,
    FrontierError,
    curves_from_rows,
    fit_frontier,
    fit_runs,
    plot_curve,
    record_breaking,
    sigmoid,
    write_report,
)
from rl_jax.scaling.synthetic import curve_rows

N_VALUES = (4, 16, 64)
BP_VALUES = (8, 32)


def _reward(n, bp, c):
    # Larger n: higher ceiling but a later take-off (IsoCompute: raise n as budget grows).
    a = {4: 0.50, 16: 0.60, 64: 0.68}[n] + 0.005 * np.log2(bp / 8)
    c_mid = {4: 2e4, 16: 8e4, 64: 3.2e5}[n]
    return sigmoid(c, r0=0.15, a=a, b=1.5, c_mid=c_mid)


def _grid_rows(noise=0.004, seed=0, n_values=N_VALUES, bp_values=BP_VALUES):
    rng = np.random.default_rng(seed)
    rows = []
    for n in n_values:
        for bp in bp_values:
            steps = np.arange(0, 401, 10)
            rollouts = steps * n * bp * 4.0  # C = B_p * n * M, M = steps
            y = _reward(n, bp, rollouts) + rng.normal(0, noise, steps.size)
            knobs = {"sampling.n": n, "data.prompts_per_batch": bp}
            rows += curve_rows(
                f"n{n}-bp{bp}", rollouts, y, recipe=f"n{n}-bp{bp}", knobs=knobs, x_key="rollouts"
            )
    return rows


def test_record_breaking_by_hand():
    x = np.array([0, 1, 2, 3, 4, 4, 5])
    y = np.array([0.1, 0.3, 0.2, 0.3, 0.5, 0.6, 0.55])
    assert record_breaking(x, y).tolist() == [True, True, False, False, False, True, False]
    # Order-free: pooled runs arrive unsorted.
    perm = np.array([6, 2, 0, 5, 1, 3, 4])
    assert record_breaking(x[perm], y[perm]).tolist() == record_breaking(x, y)[perm].tolist()
    kept = record_breaking(x, y)
    assert np.all(np.diff(y[kept]) > 0)


def test_frontier_recovers_the_compute_optimal_n():
    curves = curves_from_rows(_grid_rows(), x="rollouts")
    fr = fit_frontier(curves)
    assert fr.n_values == N_VALUES and fr.bp_values == BP_VALUES
    assert set(fr.fits) == set(N_VALUES)
    for n, f in fr.fits.items():
        truth = _reward(n, 32, np.array([1e12]))[0]  # best B_p's ceiling
        assert f.A == pytest.approx(truth, abs=0.02)
    ok = np.isfinite(fr.n_star)
    ns = fr.n_star[ok]
    assert ns[0] == 4 and ns[-1] == 64
    assert np.all(np.diff(np.log2(ns)) >= 0)  # n* never decreases with budget
    # The envelope is the best fitted curve wherever it is defined, and never falls.
    for n, f in fr.fits.items():
        lo, hi = fr.ranges[n]
        inside = (fr.c_grid >= lo) & (fr.c_grid <= hi)
        assert np.all(fr.envelope[inside] >= f.predict(fr.c_grid[inside]) - 1e-12)
    assert np.all(np.diff(fr.envelope[ok]) >= -1e-12)
    # True switch points: where the ceilings' sigmoids cross.
    c = np.geomspace(fr.c_grid[0], fr.c_grid[-1], 400)
    true_best = np.array(N_VALUES)[np.argmax([_reward(n, 32, c) for n in N_VALUES], axis=0)]
    nf = fr.n_star_fit
    assert nf is not None and nf.A > nf.R0  # rising
    assert 2**nf.R0 == pytest.approx(4, rel=0.3) and 2**nf.A == pytest.approx(64, rel=0.3)
    switch_16 = c[np.argmax(true_best >= 16)]
    assert fr.n_star_at(switch_16 * 0.5) < 16 < fr.n_star_at(switch_16 * 8)
    s = fr.summary()
    assert s["n_values"] == list(N_VALUES) and s["n_star_fit"]["C_mid"] == nf.C_mid


def test_sensitivity_n_dominates_bp():
    fr = fit_frontier(curves_from_rows(_grid_rows(), x="rollouts"), budgets=[5e4, 2e5, 3e6])
    assert fr.budgets == (5e4, 2e5, 3e6)
    for r in fr.sensitivity[:2]:
        assert r["reward_range_over_n"] > 3 * r["reward_range_over_bp"]
        assert r["bp_columns_used"] >= 1 and r["n_rows_used"] >= 1
    # Only the largest run reaches 3e6: no spread to measure, and it says so (nan, 0 used).
    late = fr.sensitivity[2]
    assert late["runs_covering"] == 1 and late["n_rows_used"] == 0
    assert np.isnan(late["reward_range_over_n"])
    mat = fr.heat[2e5]
    assert mat.shape == (len(N_VALUES), len(BP_VALUES))
    # Hand check of one cell: run n=16, B_p=32 at budget 2e5, best-so-far reward there.
    rows = [r for r in _grid_rows() if r["run_id"] == "n16-bp32"]
    x = np.array([r["rollouts"] for r in rows])
    y = np.maximum.accumulate([r["val/pass@1"] for r in rows])
    want = np.interp(np.log(2e5), np.log(x[1:]), y[1:])
    assert mat[N_VALUES.index(16), BP_VALUES.index(32)] == pytest.approx(want)


def test_frontier_degenerate_inputs_fail_clearly():
    curves = curves_from_rows(_grid_rows(), x="rollouts")
    with pytest.raises(FrontierError, match="got 1 run"):
        fit_frontier(curves[:1])
    single_n = [c for c in curves if c.meta["sampling.n"] == 16]
    with pytest.raises(FrontierError, match="at least two values"):
        fit_frontier(single_n)
    bare = [
        Curve(run_id=c.run_id, group=c.group, x=c.x, y=c.y, steps=None, meta={}) for c in curves
    ]
    with pytest.raises(FrontierError, match="no numeric 'sampling.n'"):
        fit_frontier(bare)


def test_constant_n_star_is_reported_not_fitted():
    # Over the same compute range, n = 16 wins everywhere (same take-off, higher ceiling).
    rows = []
    for n, a in ((4, 0.4), (16, 0.6)):
        x = np.arange(0, 401, 10) * 64.0
        y = sigmoid(x, r0=0.1, a=a, b=2.0, c_mid=1e4)
        rows += curve_rows(
            f"n{n}", x, y, knobs={"sampling.n": n, "data.prompts_per_batch": 8}, x_key="rollouts"
        )
    fr = fit_frontier(curves_from_rows(rows, x="rollouts"))
    assert fr.n_star_fit is None and "never switches" in fr.n_star_note
    with pytest.raises(FrontierError, match="no n"):
        fr.n_star_at(1e5)


def test_isocompute_report_and_plots(tmp_path):
    rep = fit_runs(
        _grid_rows(), x="rollouts", method="lsq", n_boot=30, extrapolate=None, group_by=None
    )
    assert rep.frontier is not None and rep.frontier.n_values == N_VALUES
    names = {p.relative_to(tmp_path).as_posix() for p in write_report(rep, tmp_path)}
    for stem in ("frontier", "frontier_heatmap", "n_star"):
        assert {f"plots/{stem}.png", f"plots/{stem}.svg"} <= names
    summary = json.loads((tmp_path / "isocompute.json").read_text())
    assert summary["n_star_fit"]["log2_n_high"] > summary["n_star_fit"]["log2_n_low"]
    md = (tmp_path / "report.md").read_text()
    assert "## Iso-compute analysis" in md and "n*(C): log2 n* =" in md
    # plot_curve is the one-run entry point (the trainer's demo).
    f = rep.entries[0]
    c = rep.curves[0]
    paths = plot_curve(c.x, c.y, tmp_path / "one", fit=f.fit, boot=f.boot)
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size for p in paths)
