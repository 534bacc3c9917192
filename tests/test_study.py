"""The seeded leave-one-out study (rl_jax.scaling.analyse_study, `rl-jax study`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rl_jax.cli import main as cli_main
from rl_jax.scaling import PaperFinding, analyse_study, curves_from_rows
from rl_jax.scaling._study import (
    _pooled_sd,
    _t_interval,
    classify_a,
    classify_b,
    mean_curve,
    verdict,
)
from rl_jax.scaling.synthetic import curve_rows, synthetic_curve

# Known truths: the baseline, a variant with a lower asymptote, one with a slower B, one
# whose curves are the baseline's exactly (a component that cannot act).
TRUTH = {"base": (0.85, 1.5), "lowA": (0.72, 1.5), "slow": (0.85, 0.7), "same": None}


def _rows(noise=0.01, seeds=3):
    rng = np.random.default_rng(0)
    rows, base = [], {}
    for g, ab in TRUTH.items():
        for s in range(seeds):
            if ab is None:
                x, y = base[s]
            else:
                x, y = synthetic_curve(
                    rng, r0=0.3, a=ab[0], b=ab[1], c_mid=2e12, c_max=1.6e13, n_points=24,
                    noise=noise,
                )  # fmt: skip
            if g == "base":
                base[s] = (x, y)
            rows += curve_rows(f"{g}_s{s}", x, y, knobs={"group": g, "seed": s, "variant": g})
    return rows


@pytest.fixture(scope="module")
def study():
    curves = curves_from_rows(_rows(), group_by="group")
    paper = {g: PaperFinding("tie", "lower", "the paper's words") for g in ("lowA", "slow")}
    return analyse_study(curves, baseline="base", paper=paper)


def test_pooled_sd_and_t_interval_by_hand():
    sd, df = _pooled_sd([[1.0, 3.0], [2.0, 2.0, 5.0], [7.0]])
    # squares about the means: 2 + (1 + 1 + 4) = 8 over 1 + 2 = 3 degrees of freedom
    assert df == 3 and sd == pytest.approx(math.sqrt(8 / 3))
    lo, hi = _t_interval(1.0, 0.5, 4, 0.95)
    assert (lo, hi) == pytest.approx((1.0 - 2.7764451 * 0.5, 1.0 + 2.7764451 * 0.5))
    assert _t_interval(1.0, 0.5, 0, 0.95) == (-math.inf, math.inf)


def test_classes_and_verdicts():
    assert classify_a(0.03, 0.09, 0.06, 0.02) == "higher"
    assert classify_a(-0.09, -0.03, -0.06, 0.02) == "lower"
    assert classify_a(0.002, 0.012, 0.007, 0.02) == "differs within band"
    assert classify_a(-0.015, 0.019, 0.002, 0.02) == "tie"
    assert classify_a(-0.05, 0.01, -0.02, 0.02) == "not resolved"
    assert classify_b(-0.5, -0.1, -0.3) == "lower"
    assert classify_b(-0.5, 0.1, -0.2) == "not resolved"
    tie_lower = PaperFinding("tie", "lower")
    assert verdict("tie", "lower", tie_lower) == "agrees"
    assert verdict("differs within band", "lower", tie_lower) == "agrees"
    assert verdict("tie", "higher", tie_lower) == "disagrees on B"
    assert verdict("tie", "not resolved", tie_lower) == "agrees on A; B not resolved"
    assert verdict("lower", "lower", tie_lower) == "disagrees on A"
    assert verdict("not resolved", "lower", tie_lower) == "not resolved at this scale"
    assert verdict("identical", "identical", tie_lower) == "cannot differ in this setting"
    assert verdict("lower", "", PaperFinding("lower", "")) == "agrees"
    with pytest.raises(ValueError, match="PaperFinding.a"):
        PaperFinding("better", "")


def test_study_finds_the_planted_effects(study):
    eff = {e.group: e for e in study.effects}
    assert set(eff) == {"lowA", "slow", "same"}
    low = eff["lowA"]
    assert low.a_class == "lower" and low.dA_interval[1] < -0.02
    assert low.dA == pytest.approx(-0.13, abs=0.03)
    assert low.verdict == "disagrees on A"
    slow = eff["slow"]
    assert slow.b_class == "lower" and slow.dB_interval[1] < 0
    assert eff["same"].a_class == "identical" and eff["same"].dA == 0.0
    assert eff["same"].verdict == "cannot differ in this setting"
    # the seed noise is the fits' spread, pooled over every recipe's seeds
    a = [[s.fit.A for s in v] for v in study.seed_fits.values()]
    assert study.noise["df_A"] == study.noise["df_B"] == 4 * 2
    assert study.noise["sd_A"] == pytest.approx(_pooled_sd(a)[0])


def test_extrapolation_of_the_seed_mean_curve(study):
    base = [c for c in study.report.curves if c.group == "base"]
    x, y = mean_curve(base)
    assert np.allclose(y, np.mean([c.y for c in base], axis=0))
    m = study.baseline_mean
    assert m is not None and m.fraction == 0.5
    assert m.y_test[-1] == pytest.approx(y[-1])


def test_mean_curve_uses_common_steps_only():
    rows = curve_rows("a", [0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4], knobs={"group": "g"})
    rows += curve_rows("b", [0, 1, 2], [0.3, 0.4, 0.5], knobs={"group": "g"})
    x, y = mean_curve(curves_from_rows(rows, group_by="group"))
    assert x.tolist() == [0.0, 1.0, 2.0] and y == pytest.approx([0.2, 0.3, 0.4])


SPEC = """
from rl_jax.grid import Axis, GridSpec, ReportSpec
from rl_jax.scaling import PaperFinding

def grid():
    return GridSpec(
        name="toy_loo",
        recipe="scalerl",
        axes=(Axis.variants("variant", {{g: {{}} for g in ("base", "lowA", "slow", "same")}}),),
        seeds=(0, 1, 2),
        report=ReportSpec(x="flops", baseline="{baseline}", n_boot=50,
                          paper={{"lowA": PaperFinding("tie", "lower", "paper")}}),
    )
"""


def test_cli_collects_and_regenerates_bit_for_bit(tmp_path, capsys):
    spec = tmp_path / "toy_loo.py"
    spec.write_text(SPEC.format(baseline="base"))
    grid = tmp_path / "grid"
    grid.mkdir()
    rows = [{**r, "status": "done", "train.lr": 1e-5, "huge": "x" * 100} for r in _rows()]
    (grid / "curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "study"
    assert cli_main(["study", str(spec), "--out", str(out), "--from", str(grid)]) == 0
    kept = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    assert len(kept) == len(rows) and "huge" not in kept[0] and "train.lr" not in kept[0]
    assert kept[0]["variant"] == "base" and kept[0]["seed"] == 0
    first = {n: (out / n).read_bytes() for n in ("report.md", "study.json")}
    assert (out / "plots" / "loo_lowA.png").is_file()
    assert cli_main(["study", str(spec), "--out", str(out), "--no-plots"]) == 0
    assert {n: (out / n).read_bytes() for n in first} == first
    s = json.loads(first["study.json"])
    assert [e["group"] for e in s["effects"]] == ["lowA", "slow", "same"]
    assert s["effects"][0]["paper"] == {"A": "tie", "B": "lower"}
    assert "| lowA |" in first["report.md"].decode()


def test_cli_bad_input_exits_2(tmp_path, capsys):
    spec = tmp_path / "toy_loo.py"
    spec.write_text(SPEC.format(baseline="nope"))
    out = tmp_path / "study"
    assert cli_main(["study", str(spec), "--out", str(out)]) == 2
    assert "curves.jsonl not found" in capsys.readouterr().err
    assert cli_main(["study", str(spec), "--out", str(out), "--from", str(tmp_path)]) == 2
    assert "run `rl-jax grid` first" in capsys.readouterr().err
    grid = tmp_path / "grid"
    grid.mkdir()
    (grid / "curves.jsonl").write_text(
        "".join(json.dumps({**r, "status": "done"}) + "\n" for r in _rows(seeds=2))
    )
    assert cli_main(["study", str(spec), "--out", str(out), "--from", str(grid)]) == 2
    assert "baseline 'nope' has no curves" in capsys.readouterr().err
    assert cli_main(["study", str(tmp_path / "missing.py"), "--out", str(out)]) == 2


@pytest.mark.parametrize(
    "spec, sub",
    [
        ("scalerl_study_cpu", ""),
        ("scalerl_fp32head_bf16_cpu", "fp32head_bf16"),
        ("scalerl_forward_study_cpu", "forward"),
    ],
)
def test_committed_study_regenerates_bit_for_bit(tmp_path, spec, sub):
    """The committed CPU studies' reports are what today's fitting code makes of their curves."""
    from pathlib import Path

    root = Path(__file__).parents[1] / "experiments/results/scalerl_cpu" / sub
    out = tmp_path / "study"
    out.mkdir()
    (out / "curves.jsonl").write_bytes((root / "curves.jsonl").read_bytes())
    assert cli_main(["study", spec, "--out", str(out), "--no-plots"]) == 0
    for name in ("study.json", "report.md"):
        assert (out / name).read_text() == (root / name).read_text(), name


def test_unpinned_a_is_not_resolved_and_left_out_of_the_noise():
    """A curve still rising at its end puts A on its bound: no A difference can be read."""
    rng = np.random.default_rng(3)
    rows = []
    for g in ("base", "var"):
        for s in range(2):
            # C_mid beyond the last evaluation: the fit cannot see the ceiling
            x, y = synthetic_curve(
                rng, r0=0.3, a=0.9, b=1.0, c_mid=5e13, c_max=1e13, n_points=16, noise=0.01
            )
            rows += curve_rows(f"{g}{s}", x, y, knobs={"group": g, "seed": s})
    st = analyse_study(curves_from_rows(rows, group_by="group"), baseline="base")
    (e,) = st.effects
    unpinned = [s for v in st.seed_fits.values() for s in v if not s.a_pinned]
    assert unpinned and e.a_class == "not resolved (A unpinned)"
    assert e.verdict == "no paper finding"
    assert any("upper bound" in n for n in st.notes)


def test_report_fit_options_are_checked():
    from rl_jax.config import ConfigError
    from rl_jax.grid import ReportSpec

    assert ReportSpec(r0="fit", fit_start="10%").fit_start == "10%"
    with pytest.raises(ConfigError, match="r0="):
        ReportSpec(r0="last")
    with pytest.raises(ConfigError, match="fit_start="):
        ReportSpec(fit_start="ten%")
    with pytest.raises(ConfigError, match="not PaperFinding"):
        ReportSpec(paper={"a": ("tie", "lower")})


def test_a_recipe_without_a_fit_is_named_not_compared():
    """A baseline too short to fit: every variant says so instead of raising."""
    rows = curve_rows("b0", [0, 1], [0.5, 0.6], knobs={"group": "base", "seed": 0})
    rows += _rows()[:25]  # one run of TRUTH's first recipe, renamed below
    for r in rows[2:]:
        r["group"], r["run_id"] = "var", "v0"
    st = analyse_study(curves_from_rows(rows, group_by="group"), baseline="base")
    assert st.effects == [] and any("no fit of base" in n for n in st.notes)


def test_hostile_recipe_names_keep_the_study_tables_whole(tmp_path):
    """A recipe named with '|' or a line break is one cell of each table's row."""
    from rl_jax.scaling import write_study

    rng = np.random.default_rng(5)
    rows = []
    for g, a in (("base", 0.8), ("v|1\nx", 0.7)):
        for s in range(2):
            x, y = synthetic_curve(
                rng, r0=0.3, a=a, b=1.5, c_mid=2e12, c_max=1.6e13, n_points=24, noise=0.005
            )
            rows += curve_rows(f"r{a}{s}", x, y, knobs={"group": g, "seed": s})
    st = analyse_study(curves_from_rows(rows, group_by="group"), baseline="base", n_boot=20)
    write_study(st, tmp_path, title="t", plots=False)
    md = (tmp_path / "report.md").read_text().splitlines()
    assert not any(ln.startswith(("x |", "x]", "x**")) for ln in md)  # no name cut in two
    for ln in md:
        if ln.startswith("| v"):
            head = next(h for h in md[: md.index(ln)][::-1] if h.startswith("|---"))
            assert ln.replace("\\|", "").count("|") == head.count("|"), ln


def test_paired_differences_cancel_a_shared_seed_start(tmp_path):
    """Each seed shifts both recipes' A alike (a shared warm-up): compared seed by seed,
    the variant's 0.04 lower A is resolved; pooled over seeds, the seeds' spread hides it."""
    from rl_jax.scaling import write_study

    rng = np.random.default_rng(5)
    rows = []
    for g, d in (("base", 0.0), ("var", -0.04)):
        for s, off in enumerate((-0.08, 0.0, 0.08)):
            x, y = synthetic_curve(
                rng, r0=0.3, a=0.8 + off + d, b=1.5, c_mid=2e12, c_max=1.6e13, n_points=24,
                noise=0.002,
            )  # fmt: skip
            rows += curve_rows(f"{g}{s}", x, y, knobs={"group": g, "seed": s})
    curves = curves_from_rows(rows, group_by="group")
    st = analyse_study(curves, baseline="base", n_boot=20, paired=True)
    (e,) = st.effects
    per_seed = [
        v.fit.A - b.fit.A for b, v in zip(st.seed_fits["base"], st.seed_fits["var"], strict=True)
    ]
    assert e.paired_seeds == 3 and e.dA == pytest.approx(np.mean(per_seed))
    se = np.std(per_seed, ddof=1) / math.sqrt(3)
    assert e.dA_interval == pytest.approx(_t_interval(np.mean(per_seed), se, 2, 0.95))
    assert e.a_class == "lower" and e.dA == pytest.approx(-0.04, abs=0.01)
    (u,) = analyse_study(curves, baseline="base", n_boot=20).effects
    assert u.a_class == "not resolved" and u.dA_interval == e.dA_interval_unpaired
    write_study(st, tmp_path, title="t", plots=False)
    md = (tmp_path / "report.md").read_text()
    assert "Paired by seed" in md and "- var: dA [" in md
    assert json.loads((tmp_path / "study.json").read_text())["effects"][0]["paired_seeds"] == 3
