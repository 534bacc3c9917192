"""The grid's use of rl_jax.scaling on synthetic curves: splits, pooled seeds, early stops."""

import numpy as np
import pytest

from rl_jax.config import ConfigError
from rl_jax.grid import Axis, EarlyStop, GridSpec, ReportSpec, expand
from rl_jax.grid.results import early_stopper, evaluations, fit_grid, gather


def sig(c, *, r0=0.1, a, b=2.0, c_mid):
    c = np.asarray(c, float)
    with np.errstate(over="ignore", divide="ignore"):
        return r0 + (a - r0) / (1 + (c_mid / c) ** b)


C = np.array([0, 5, 10, 20, 40, 80, 160, 320, 640, 1280.0])


def rows_for(plans, curve_of):
    """Curve rows as the trainer writes them; curve_of(plan) -> (x, y)."""
    out = []
    for p in plans:
        x, y = curve_of(p)
        for i, (xi, yi) in enumerate(zip(x, y, strict=True)):
            out.append(
                {
                    "run_id": p.run_id,
                    "step": i,
                    "rollouts": float(xi),
                    "val/pass@1": float(yi),
                    "group": p.group,
                    "sampling.n": p.config.sampling.n,
                    "data.prompts_per_batch": p.config.data.prompts_per_batch,
                }
            )
    return out


def test_isocompute_splits_get_their_own_frontier():
    spec = GridSpec(
        name="iso",
        recipe="scalerl",
        axes=(
            Axis.variants("split", {"easy": {"data.difficulty": 1}, "hard": {}}),
            Axis.of("sampling.n", [2, 4], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4], short="bp"),
        ),
        report=ReportSpec(kind="isocompute", split_by="split"),
    )
    plans = expand(spec)

    def curve(p):
        # easy: n=4 overtakes n=2 between C = 80 and 160; hard: n=2 stays best throughout.
        split, n = dict(p.labels)["split"], p.config.sampling.n
        a = {("easy", 2): 0.4, ("easy", 4): 0.8, ("hard", 2): 0.5, ("hard", 4): 0.3}[(split, n)]
        c_mid = {2: 10, 4: 100}[n]
        bump = 0.01 * (p.config.data.prompts_per_batch == 4)
        return C, sig(C, a=a + bump, c_mid=c_mid) + 0.002 * np.cos(np.arange(C.size) + n)

    fits = fit_grid(spec, plans, rows_for(plans, curve))
    assert set(fits) == {"easy", "hard"}
    easy, hard = fits["easy"][0], fits["hard"][0]
    assert {r["recipe"] for r in easy.table} == {
        "easy_n2_bp2",
        "easy_n2_bp4",
        "easy_n4_bp2",
        "easy_n4_bp4",
    }
    assert easy.table[0]["recipe"].startswith("easy_n4")
    fe, fh = easy.frontier, hard.frontier
    assert fe.n_star[0] == 2 and fe.n_star[-1] == 4
    assert fe.n_star_fit is not None and 40 <= fe.n_star_fit.C_mid <= 320
    assert set(fh.n_star[np.isfinite(fh.n_star)].tolist()) == {2.0}


def test_compare_pools_seeds_into_one_recipe_each():
    spec = GridSpec(
        name="cmp",
        recipe="scalerl",
        axes=(Axis.variants("v", {"base": {}, "alt": {"loss.name": "dapo"}}),),
        seeds=(0, 1),
        report=ReportSpec(kind="compare"),
    )
    plans = expand(spec)
    c = np.concatenate([[0.0], np.geomspace(1, 1e4, 16)])
    truth = {"base": dict(a=0.60, b=1.5, c_mid=300), "alt": dict(a=0.45, b=1.0, c_mid=300)}

    def curve(p):
        noise = (0.004 if p.seed else -0.004) * np.cos(np.arange(c.size))
        return c, sig(c, **truth[p.group]) + noise

    ((rep, note),) = fit_grid(spec, plans, rows_for(plans, curve)).values()
    assert note == "" and rep.frontier is None
    table = {r["recipe"]: r for r in rep.table}
    assert table["base"]["runs"] == 2 and table["base"]["rank"] == 1
    for g, t in truth.items():
        assert table[g]["A"] == pytest.approx(t["a"], abs=0.01)
        assert table[g]["A_lo"] <= table[g]["A"] <= table[g]["A_hi"]


def test_early_stopper_flags_the_hopeless_group_after_min_fraction():
    spec = GridSpec(
        name="es",
        recipe="scalerl",
        base={"train.steps": 60},
        axes=(Axis.of("sampling.n", [2, 4], short="n"),),
        early_stop=EarlyStop(threshold=0.05, min_fraction=0.5, min_points=4),
        report=ReportSpec(x="rollouts"),
    )
    plans = expand(spec)  # 60 steps each
    by_n = {p.config.sampling.n: p for p in plans}
    check = early_stopper(spec, plans)

    def curves_upto(k):
        rows = rows_for(
            plans, lambda p: (C, sig(C, a=0.3 if p.config.sampling.n == 2 else 0.8, c_mid=40))
        )
        for r in rows:  # evaluation i at step 10 * i
            r["step"] = 10 * r["step"]
        return {p.run_id: [r for r in rows if r["run_id"] == p.run_id][:k] for p in plans}

    # 6 evaluations = step 50 of 60: past min_fraction; n=2 cannot reach n=4's asymptote.
    out = check(curves_upto(6), plans)
    assert set(out) == {by_n[2].run_id}
    assert out[by_n[2].run_id]["leader"] == by_n[4].group and out[by_n[2].run_id]["p"] < 0.05
    # 3 evaluations (step 20 < 30): too few points and too early to judge.
    assert check(curves_upto(3), plans) == {}


def test_report_of_a_run_with_a_damaged_curve_names_the_file(tmp_path):
    """A curve.jsonl with a bad line before its last: a ConfigError naming the file and
    line (exit 2 from `rl-jax grid --report-only`), not a ValueError traceback."""
    spec = GridSpec(name="g", recipe="scalerl", axes=(Axis.of("sampling.n", [2, 4]),))
    plans = expand(spec)
    bad = tmp_path / "runs" / plans[1].name / "curve.jsonl"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"step": 1, "rollouts": 8}\n{oops\n{"step": 2, "rollouts": 16}\n')
    status = {p.run_id: "done" for p in plans}
    with pytest.raises(ConfigError, match=rf"{bad}: line 2 is not JSON.*{plans[1].name}"):
        gather(spec, plans, str(tmp_path), str(tmp_path / "runs"), status)


@pytest.mark.parametrize("step", ["x", None, [1]])
def test_curve_row_whose_step_is_not_a_number_is_a_config_error(step):
    """`rl-jax grid --replay-early CURVES` and the report sort evaluations by step: a row
    with step 'x' or null is a ConfigError naming its run, not a TypeError traceback."""
    rows = [{"run_id": "r0", "step": s, "rollouts": 8.0 * s, "val/pass@1": 0.1} for s in (1, 2)]
    rows.append({"run_id": "r1", "step": step, "rollouts": 8.0, "val/pass@1": 0.1})
    with pytest.raises(ConfigError, match=r"run r1 has step=.*not a number"):
        evaluations(rows, "rollouts", "val/pass@1")
