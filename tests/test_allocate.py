"""`rl-jax allocate` and scaling.allocate on a synthetic iso-compute grid whose frontier is
known: the compute-optimal n and B_p per budget, M, the interval, extrapolation, bad input."""

import json

import numpy as np
import pytest

from rl_jax.cli import main
from rl_jax.scaling import allocate, curves_from_rows, fit_frontier, sigmoid
from rl_jax.scaling.synthetic import isocompute_rows

C_MAX = 1e5
# Larger n: a higher ceiling and a later take-off (IsoCompute); B_p = 16 a little better.
CELLS = {
    (n, bp): {"r0": 0.1, "a": a + 0.03 * (bp == 16), "b": 1.5, "c_mid": c_mid}
    for n, (a, c_mid) in {2: (0.45, 3e3), 8: (0.60, 1e4), 32: (0.75, 3e4)}.items()
    for bp in (4, 16)
}


def true_best(c: float) -> tuple[int, int, float]:
    vals = {k: float(sigmoid(c, **p)) for k, p in CELLS.items()}
    (n, bp), v = max(vals.items(), key=lambda kv: kv[1])
    return n, bp, v


@pytest.fixture(scope="module")
def rows():
    return isocompute_rows(
        np.random.default_rng(0), CELLS, c_max=C_MAX, n_points=24, tokens_per_rollout=5.0
    )


@pytest.fixture(scope="module")
def frontier(rows):
    curves = curves_from_rows(rows, x="rollouts", group_by=None)
    return fit_frontier(curves), curves


@pytest.mark.parametrize("budget", [6e3, 3e4, 8e4])
def test_allocate_picks_the_true_compute_optimal_cell(frontier, budget):
    fr, curves = frontier
    n, bp, value = true_best(budget)
    al = allocate(fr, curves, budget, n_boot=100)
    assert (al.best.n, al.best.bp) == (n, bp)
    assert al.best.steps == int(budget // (n * bp))  # M = C / (B_p * n)
    assert al.extrapolation == 1.0 and not al.notes
    # The frontier runs through record-breaking (best-so-far) evaluations, a little above the
    # mean curve; one new run's evaluation falls in the predictive interval.
    assert al.interval[0] <= al.reward <= al.interval[1]
    assert al.predictive[0] <= value <= al.predictive[1]
    assert al.predictive[0] < al.interval[0] and al.interval[1] < al.predictive[1]
    assert abs(al.reward - value) < 0.01
    assert al.best.p_best > 0.9
    # Every n is a candidate, best first; its B_p is the better one of its cells.
    ns = {k[0] for k in CELLS}
    assert [c.n for c in al.candidates] == sorted(
        ns, key=lambda m: -float(sigmoid(budget, **CELLS[(m, 16)]))
    )
    for c in al.candidates:  # where B_p's effect clears the noise, the better B_p
        gap = sigmoid(budget, **CELLS[(c.n, 16)]) - sigmoid(budget, **CELLS[(c.n, 4)])
        assert c.bp == 16 or gap < 0.01


def test_allocate_says_how_far_it_extrapolates(frontier):
    fr, curves = frontier
    al = allocate(fr, curves, 4 * C_MAX, n_boot=50)
    assert al.extrapolation == pytest.approx(4.0)
    assert len(al.notes) == 1 and "EXTRAPOLATION" in al.notes[0] and "4x" in al.notes[0]
    assert al.best.n == 32 and al.best.steps == int(4 * C_MAX // (32 * 16))
    # Past the data each sigmoid is extended, not held flat: more reward than at C_max.
    assert al.reward > allocate(fr, curves, C_MAX, n_boot=50).reward
    below = allocate(fr, curves, fr.c_grid[0] / 2, n_boot=50)
    assert below.extrapolation == pytest.approx(2.0) and "below" in below.notes[0]


def write_grid(tmp_path, rows, *, plan=True):
    d = tmp_path / "syn_grid"
    d.mkdir()
    (d / "curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if plan:
        runs = []
        for (n, bp), _ in CELLS.items():
            m = int(C_MAX // (n * bp))
            over = [f"sampling.n={n}", f"data.prompts_per_batch={bp}", f"train.steps={m}"]
            over += [f"eval.every={m // 12}", "train.seed=0", "data.reverse_digits=true"]
            runs.append({"run_id": f"n{n}_bp{bp}", "steps": m, "overrides": over})
        (d / "plan.json").write_text(json.dumps({"grid": "syn_grid", "runs": runs}))
    return d


def test_cli_prints_the_allocation_and_the_command(tmp_path, rows, capsys):
    d = write_grid(tmp_path, rows)
    assert main(["allocate", "--from", str(d), "--budget", "8e4", "--recipe", "isocompute"]) == 0
    out = capsys.readouterr().out
    assert "n = 32, B_p = 16, M = 156 steps" in out
    assert "EXTRAPOLATION" not in out
    run = next(ln for ln in out.splitlines() if ln.startswith("run: "))
    # The cell's other knobs kept, the allocation's set, evaluations as many as the grid's.
    assert run == (
        "run: rl-jax train isocompute train.seed=0 data.reverse_digits=true sampling.n=32"
        " data.prompts_per_batch=16 train.steps=156 eval.every=13"
    )
    # Budgets in tokens: the same cells, C counted in generated tokens (5 per rollout).
    args = ["allocate", "--from", str(d / "curves.jsonl"), "--budget", "4e5", "--unit", "tokens"]
    assert main([*args, "--json", "train.lr=1e-5"]) == 0
    res = json.loads(capsys.readouterr().out)
    best = res["allocation"]["candidates"][0]
    assert (best["n"], best["bp"], best["steps"]) == (32, 16, 156)
    assert res["allocation"]["x"] == "generated_tokens"
    assert res["command"]["argv"] is None and "train.lr=1e-5" in res["command"]["overrides"]


def test_cli_reads_a_split_from_its_fits_directory(tmp_path, rows, capsys):
    easy = [{**r, "split": "easy"} for r in rows]
    hard = [{**r, "split": "hard", "val/pass@1": r["val/pass@1"] / 2} for r in rows]
    d = write_grid(tmp_path, easy + hard, plan=False)
    (d / "fits" / "hard").mkdir(parents=True)
    assert main(["allocate", "--from", str(d / "fits" / "hard"), "--budget", "3e4"]) == 0
    out = capsys.readouterr().out
    assert "split hard" in out and "no plan.json" in out
    # The whole grid holds two splits: which one must be said.
    assert main(["allocate", "--from", str(d), "--budget", "3e4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--split" in err and "['easy', 'hard']" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--budget", "-5"], "--budget '-5'"),
        (["--budget", "lots"], "--budget 'lots'"),
        (["--budget", "inf"], "finite"),
        (["--budget", "1e4", "--unit", "furlongs"], "--unit 'furlongs'"),
        (["--budget", "1e4", "--unit", "flops"], "flops"),  # the curves have no such column
        (["--budget", "1e4", "--split", "medium"], "--split 'medium'"),
        (["--budget", "1e4", "--topology", "v9z-8"], "v9z"),
        (["--budget", "1e4", "--level", "95"], "--level"),
        (["--budget", "1e4", "notakeyvalue"], "key=value"),
        (["--budget", "1e4", "--recipe", "isocompute", "train.lrr=1"], "train.lrr"),
        (["--budget", "1e4", "--recipe", "nosuchrecipe"], "nosuchrecipe"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path, rows, capsys, args, needle):
    d = write_grid(tmp_path, rows)
    assert main(["allocate", "--from", str(d), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("rl-jax allocate: config error:")
    assert needle in err


def test_cli_bad_sources_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "one.jsonl").write_text(json.dumps({"run_id": "a", "rollouts": 1.0}) + "\n")
    for src, needle in [
        (tmp_path / "missing", "not a grid directory"),
        (tmp_path / "empty", "not a grid directory"),
        (tmp_path / "one.jsonl", "val/pass@1"),
    ]:
        assert main(["allocate", "--from", str(src), "--budget", "1e4"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and needle in err, err


def test_cli_prices_candidates_on_a_topology(tmp_path, rows, capsys):
    d = write_grid(tmp_path, rows)
    args = ["allocate", "--from", str(d), "--budget", "8e4", "--recipe", "isocompute"]
    assert main([*args, "--topology", "v5p-8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    prices = res["prices"]
    assert [(p["n"], p["bp"]) for p in prices] == [
        (c["n"], c["bp"]) for c in res["allocation"]["candidates"]
    ]
    for p in prices:
        assert p["fits"] and p["hours"] == pytest.approx(8e4 / p["rollouts_per_hour"])
        assert p["chip_hours"] == pytest.approx(4 * p["hours"])  # v5p-8: 4 chips
    argv = res["command"]["argv"]
    assert all(o in argv for o in prices[0]["mesh_overrides"])
    assert res["command"]["plan_argv"][:3] == ["rl-jax", "plan", "isocompute"]
    assert res["command"]["plan_argv"][-4:] == ["--topology", "v5p-8", "--budget-rollouts", "80000"]
    # The tiny recipe's prompts are sized by its data: the price says what it leaves out.
    assert any("sampling.max_prompt_len" in n for n in res["command"]["notes"])


def test_cli_reads_a_grid_in_a_bucket(tmp_path, rows, capsys):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    local = write_grid(tmp_path, rows)
    root = f"/{tmp_path.name}/grids/syn_grid"
    for f in local.iterdir():
        fs.pipe(f"{root}/{f.name}", f.read_bytes())
    fs.pipe(f"{root}/fits/all/fits.json", b"{}")
    try:
        url = f"memory://{root.lstrip('/')}/fits/all"
        args = ["allocate", "--from", url, "--budget", "8e4", "--recipe", "isocompute"]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "n = 32, B_p = 16, M = 156 steps" in out and "train.steps=156" in out
    finally:
        fs.rm(f"/{tmp_path.name}", recursive=True)


@pytest.mark.parametrize(
    "dirname, grid_column",
    [("isocompute_cpu", None), ("results", "isocompute_cpu"), ("isocompute_cpu", "evil")],
)
def test_cli_on_a_committed_study_takes_cell_knobs_from_its_spec(
    tmp_path, capsys, dirname, grid_column
):
    # A study committed as curves.jsonl alone: the cells' other knobs (the split's) and the
    # trainer come from the grid's spec, named by the rows' `grid` column or the directory.
    # A `grid` value that is a path is never loaded (a spec file runs code).
    if grid_column == "evil":
        grid_column = str(tmp_path / "evil.py")
        (tmp_path / "evil.py").write_text("raise SystemExit('a spec file named by rows ran')\n")
    from rl_jax.grid import expand, load_spec

    plans = expand(load_spec("isocompute_cpu"))
    rng = np.random.default_rng(0)
    rows = []
    for p in plans:
        n, bp = p.config.sampling.n, p.config.data.prompts_per_batch
        steps = np.arange(0, p.steps + 1, p.steps // 8)
        x = steps * float(n * bp)
        y = sigmoid(x, r0=0.3, a=0.5 + 0.05 * np.log2(n), b=1.5, c_mid=500.0 * n)
        for s, xi, yi in zip(steps, x, y + rng.normal(0, 0.003, x.size), strict=True):
            rows.append(
                {
                    "run_id": p.run_id,
                    "step": int(s),
                    "rollouts": xi,
                    "val/pass@1": yi,
                    "sampling.n": n,
                    "data.prompts_per_batch": bp,
                    **dict(p.labels),
                    **({"grid": grid_column} if grid_column else {}),
                }
            )
    d = tmp_path / dirname
    d.mkdir()
    (d / "curves.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["allocate", "--from", str(d), "--split", "easy", "--budget", "16384"]) == 0
    run = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("run: "))
    assert run.startswith("run: python -m rl_jax.cli.warm_train --target 0.45 isocompute ")
    assert "data.reverse_digits=true" in run and "sampling.n=8" in run
