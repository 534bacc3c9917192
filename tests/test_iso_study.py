"""The iso-compute study (rl_jax.scaling.analyse_isocompute, `rl-jax study` on an
iso-compute spec): the additive model and the fixed-batch contrast by hand, findings on
synthetic grids whose answers are planted, interference shares, the CLI."""

import json
from pathlib import Path

import numpy as np
import pytest

from rl_jax.cli import main as cli_main
from rl_jax.scaling import (
    HIST_KEY,
    additive_fit,
    analyse_isocompute,
    iso_study_json,
    write_iso_study,
)
from rl_jax.scaling._iso_report import findings
from rl_jax.scaling._iso_study import (
    _bin_values,
    effects_at,
    fixed_batch,
    interference,
    polarization,
)
from rl_jax.scaling.synthetic import isocompute_rows


def test_additive_fit_by_hand():
    mat = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 9.0]])
    alpha, beta, fitted, dof = additive_fit(mat)
    # A full table: effects are the row and column means, relative to the first.
    np.testing.assert_allclose(alpha, [0.0, 2.0, 5.5])
    np.testing.assert_allclose(beta, [0.0, 2.0])
    grand = mat.mean()
    expect = mat.mean(1, keepdims=True) + mat.mean(0, keepdims=True) - grand
    np.testing.assert_allclose(fitted, expect)
    assert dof == 6 - 4


def test_additive_fit_with_a_missing_cell_and_no_noise_left():
    mat = np.array([[1.0, 2.0], [3.0, np.nan]])
    alpha, beta, fitted, dof = additive_fit(mat)
    np.testing.assert_allclose(alpha, [0.0, 2.0])
    np.testing.assert_allclose(beta, [0.0, 1.0])
    assert dof == 0 and np.isnan(fitted[1, 1])
    assert effects_at(1.0, mat, (2, 4), (2, 4), n_boot=20, level=0.9, seed=0) is None
    # An exactly additive table with a hole: the model recovers it, residuals zero.
    full = np.add.outer([0.0, 0.1, 0.3], [0.0, 0.05, 0.02])
    full[2, 2] = np.nan
    alpha, beta, fitted, dof = additive_fit(full)
    np.testing.assert_allclose(alpha, [0.0, 0.1, 0.3], atol=1e-12)
    np.testing.assert_allclose(beta, [0.0, 0.05, 0.02], atol=1e-12)
    assert dof == 8 - 5


def test_fixed_batch_contrast_by_hand():
    # n = (2, 4), B_p = (2, 4): B = 8 has two cells (n = 2, B_p = 4) and (n = 4, B_p = 2).
    mat = np.array([[0.1, 0.5], [0.3, 0.9]])
    value, sizes = fixed_batch(mat, (2.0, 4.0), (2.0, 4.0))
    assert sizes == (8.0,) and value == pytest.approx(0.3 - 0.5)
    mat[0, 1] = np.nan
    assert np.isnan(fixed_batch(mat, (2.0, 4.0), (2.0, 4.0))[0])


def test_interference_pools_each_runs_last_histogram():
    rows = [
        {"run_id": "a", "step": 0, "sampling.n": 2, HIST_KEY: [0] * 10},
        {"run_id": "a", "step": 5, "rollouts": 50, "sampling.n": 2, HIST_KEY: [3] + [0] * 9},
        {
            "run_id": "a",
            "step": 9,
            "rollouts": 90,
            "sampling.n": 2,
            HIST_KEY: [4, 0, 0, 0, 0, 2, 0, 0, 0, 2],
        },
        {"run_id": "b", "step": 9, "rollouts": 90, "sampling.n": 2, HIST_KEY: [0] * 9 + [2]},
        {"run_id": "c", "step": 9, "sampling.n": 8, HIST_KEY: [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]},
        {"run_id": "d", "step": 9, "sampling.n": 8},
    ]
    two, eight = interference(rows, "sampling.n", n_boot=50, level=0.9, seed=0)
    assert (two["n"], two["runs"], two["problems"]) == (2, 2, 10)
    assert two["near_zero"] == pytest.approx(0.4) and two["near_one"] == pytest.approx(0.4)
    assert eight["share"][:4] == [0.25] * 4 and eight["near_one"] == 0.0
    # Rates 0 (4 problems), 0.5 (2), 1 (4): m = 0.5, Var(r) = 0.2; Var(p) = (0.2 - 0.25 / 2)
    # / (1 - 1/2) = 0.15 of at most 0.25.
    assert two["mean_pass"] == pytest.approx(0.5)
    assert two["polarization"] == pytest.approx(0.6)
    lo, hi = two["polarization_interval"]
    assert lo <= 0.6 <= hi
    # Over training: only where both runs of n = 2 were evaluated (90 rollouts, not 50).
    assert two["over_training"] == [[90.0, pytest.approx(0.6)]]


def test_polarization_takes_out_the_binomial_noise_of_n():
    from math import comb

    # Every problem at p = 0.5, eight samples each: the histogram is Binomial(8, 0.5) / 8.
    counts = np.zeros(10)
    for k in range(9):
        counts[min(int(10 * k / 8), 9)] += comb(8, k)
    mean, pol = polarization(counts, 8)
    assert mean == pytest.approx(0.5) and pol == pytest.approx(0.0, abs=1e-12)
    # All-or-nothing problems: everything between problems.
    assert polarization(np.array([7, 0, 0, 0, 0, 0, 0, 0, 0, 3]), 8)[1] == pytest.approx(1.0)
    # n = 32 puts k = 0..3 in the first bin: their mean rate stands for it.
    assert _bin_values(32, 10)[0] == pytest.approx(1.5 / 32)
    assert _bin_values(2, 10)[[0, 5, 9]].tolist() == [0.0, 0.5, 1.0]


C_MAX = 2**15
N_VALUES, BP_VALUES = (2, 4, 8, 16, 32), (2, 4, 8, 16)


def _cells(n_effect: float, bp_effect: float, grows: bool):
    """Sigmoid cells: n moves the ceiling by n_effect per doubling, B_p by bp_effect; with
    `grows`, larger n also takes off later, so small n wins small budgets (n* grows)."""
    return {
        (n, bp): {
            "r0": 0.2,
            "a": 0.45 + n_effect * np.log2(n) + bp_effect * np.log2(bp),
            "b": 1.5,
            "c_mid": (300.0 * n) if grows else 2000.0,
        }
        for n in N_VALUES
        for bp in BP_VALUES
    }


def _rows(seed, split, cells):
    rows = isocompute_rows(np.random.default_rng(seed), cells, c_max=C_MAX, n_points=16)
    for r in rows:
        r["split"] = split
        r["group"] = f"{split}_{r['group']}"
        r["run_id"] = f"{split}_{r['run_id']}"
    return rows


@pytest.fixture(scope="module")
def study():
    rows = _rows(0, "easy", _cells(0.08, 0.005, grows=True))
    rows += _rows(1, "hard", _cells(0.0, 0.0, grows=False))
    return analyse_isocompute(rows, split_by="split", n_boot=100)


def test_planted_n_effect_and_n_star_growth_are_found(study):
    easy = study.splits["easy"]
    e = easy.effects[-1]
    assert e.cells == 20 and e.dof == 12
    # The planted ceilings differ by 0.08 * 4 across n and 0.005 * 3 across B_p; the curves
    # have not all reached them at C_MAX, so the measured ranges are smaller.
    assert 0.1 < e.over_n < 0.33 and e.over_bp < 0.03
    assert e.diff_interval[0] > 0
    ns = easy.n_star
    assert ns.lo < ns.hi and ns.p_grows > 0.95
    verdicts = {(f["split"], f["id"]): f["verdict"] for f in findings(study)}
    assert verdicts[("easy", "n_vs_bp")] == verdicts[("easy", "n_star_grows")] == "agree"


def test_a_split_with_nothing_planted_is_not_resolved(study):
    hard = study.splits["hard"]
    e = hard.effects[-1]
    # Only noise differs between cells: the difference's interval covers 0.
    assert e.diff_interval[0] < 0 < e.diff_interval[1] or e.diff_interval[1] < 0
    verdicts = {f["id"]: f["verdict"] for f in findings(study) if f["split"] == "hard"}
    assert verdicts["n_vs_bp"] != "agree"


def test_split_names_are_not_paths(tmp_path):
    """A split is a value of the rows; '../../escaped' wrote its plots two directories above
    the study's, and 'a/b' into a directory of its own."""
    rows = _rows(0, "../../escaped", _cells(0.08, 0.005, grows=True))
    rows += _rows(1, "a/b", _cells(0.0, 0.0, grows=False))
    out = tmp_path / "deep" / "study"
    write_iso_study(analyse_isocompute(rows, split_by="split", n_boot=50), out, title="t")
    pngs = list(tmp_path.rglob("*.png"))
    assert pngs and all(p.parent == out / "plots" for p in pngs)
    md = (out / "report.md").read_text()
    links = [ln.split("](")[1][:-1] for ln in md.splitlines() if ln.startswith("![frontier]")]
    assert len(links) == 2 and all((out / link).is_file() for link in links)


def test_study_json_is_plain_json_and_deterministic(study):
    rows = _rows(0, "easy", _cells(0.08, 0.005, grows=True))
    rows += _rows(1, "hard", _cells(0.0, 0.0, grows=False))
    again = analyse_isocompute(rows, split_by="split", n_boot=100)
    a = json.dumps(iso_study_json(study), allow_nan=False)  # strict JSON: no NaN
    assert a == json.dumps(iso_study_json(again), allow_nan=False)
    assert json.loads(a)["splits"]["easy"]["effects"][-1]["cells"] == 20


SPEC = """
from rl_jax.grid import Axis, Budget, GridSpec, ReportSpec

def grid():
    return GridSpec(
        name="toy_iso",
        recipe="isocompute",
        axes=(
            Axis.variants("split", {"easy": {}, "hard": {}}),
            Axis.of("sampling.n", [2, 4, 8, 16, 32], short="n"),
            Axis.of("data.prompts_per_batch", [2, 4, 8, 16], short="bp"),
        ),
        budget=Budget(amount=2**15, unit="rollouts"),
        report=ReportSpec(kind="isocompute", split_by="split", n_boot=50),
    )
"""


def test_cli_collects_an_isocompute_grid_and_regenerates_bit_for_bit(tmp_path, capsys):
    spec = tmp_path / "toy_iso.py"
    spec.write_text(SPEC)
    grid = tmp_path / "grid"
    grid.mkdir()
    rows = _rows(0, "easy", _cells(0.08, 0.005, grows=True))
    rows += _rows(1, "hard", _cells(0.0, 0.0, grows=False))
    for r in rows:
        r.update({"huge": "x" * 100, "grid": "toy_iso", HIST_KEY: [1] * 10})
    (grid / "curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "study"
    assert cli_main(["study", str(spec), "--out", str(out), "--from", str(grid)]) == 0
    kept = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    assert "huge" not in kept[0] and kept[0][HIST_KEY] == [1] * 10 and kept[0]["grid"]
    assert {"sampling.n", "data.prompts_per_batch", "split"} <= kept[0].keys()
    first = {n: (out / n).read_bytes() for n in ("report.md", "study.json")}
    assert (out / "plots" / "easy_frontier.png").is_file()
    assert (out / "plots" / "hard_interference.png").is_file()
    assert cli_main(["study", str(spec), "--out", str(out), "--no-plots"]) == 0
    assert {n: (out / n).read_bytes() for n in first} == first
    md = first["report.md"].decode()
    assert "## The paper's findings and ours" in md and "## Split `hard` (20 runs)" in md
    assert cli_main(["study", str(spec), "--out", str(out), "--baseline", "x"]) == 2
    assert "--baseline: toy_iso is an iso-compute grid" in capsys.readouterr().err
    # One run left: no frontier for that split, exit 2 with the split named.
    (out / "curves.jsonl").write_text(json.dumps(kept[0]) + "\n")
    assert cli_main(["study", str(spec), "--out", str(out), "--no-plots"]) == 2
    assert "split 'easy'" in capsys.readouterr().err


def test_committed_isocompute_study_regenerates_bit_for_bit(tmp_path):
    root = Path(__file__).parents[1] / "experiments/results/isocompute_cpu"
    if not (root / "curves.jsonl").is_file():
        pytest.skip("the study is not committed yet")
    out = tmp_path / "study"
    out.mkdir()
    (out / "curves.jsonl").write_bytes((root / "curves.jsonl").read_bytes())
    assert cli_main(["study", "isocompute_study_cpu", "--out", str(out), "--no-plots"]) == 0
    for name in ("study.json", "report.md"):
        assert (out / name).read_text() == (root / name).read_text(), name
