"""Early stopping by the frontier (scaling.reach_decision) in the grid driver's check, and its
replay on recorded curves (rl-jax grid --replay-early) on a synthetic iso-compute grid whose
frontier is known: runs that cannot reach it are stopped, the frontier's pick is kept."""

import json
import textwrap

import numpy as np
import pytest

from rl_jax.cli import main
from rl_jax.grid import Axis, Budget, EarlyStop, GridSpec, ReportSpec, expand
from rl_jax.grid.replay import replay_early
from rl_jax.grid.results import early_stopper
from rl_jax.scaling import FitError, Progress, fit_sigmoid, reach_decision, sigmoid
from rl_jax.scaling.synthetic import isocompute_rows


def _fit(a, c_mid, c_max, *, n=24, seed=0, noise=0.004):
    rng = np.random.default_rng(seed)
    x = np.linspace(0, c_max, n + 1)
    y = sigmoid(x, r0=0.1, a=a, b=1.5, c_mid=c_mid) + rng.normal(0, noise, x.size)
    return fit_sigmoid(x, y)


def test_reach_decision_by_the_frontier_not_the_asymptote():
    # 'late' has finished with the higher ceiling; 'early' has the lower ceiling but is ahead
    # of 'late' until C ~ 4800: on the frontier over part of the compute it has left.
    late = Progress(fit=_fit(0.8, 5000, 9600), first=400, reached=9600, end=9600)
    early = _fit(0.45, 300, 1920, seed=1)
    young = Progress(fit=early, first=80, reached=1920, end=9600)
    rd = reach_decision({"late": late, "early": young})
    rows = {r.name: r for r in rd.rows}
    assert rows["late"].p_reach is None and not rows["late"].stop  # finished: nothing to decide
    assert rows["early"].p_reach > 0.95 and not rows["early"].stop
    # Past the crossing, its whole future lies below the frontier.
    old = Progress(fit=_fit(0.45, 300, 6000, seed=1), first=250, reached=6000, end=9600)
    rows = {r.name: r for r in reach_decision({"late": late, "early": old}).rows}
    assert rows["early"].p_reach < 0.05 and rows["early"].stop
    # Nothing measured where its future lies: it counts as reaching the frontier.
    ahead = Progress(fit=_fit(0.8, 5000, 2000), first=400, reached=2000, end=9600)
    lone = Progress(fit=_fit(0.3, 300, 8000, seed=2), first=330, reached=8000, end=9600)
    rows = {r.name: r for r in reach_decision({"ahead": ahead, "lone": lone}).rows}
    assert not rows["ahead"].stop and not rows["lone"].stop
    with pytest.raises(FitError, match="threshold"):
        reach_decision({"late": late, "early": young}, threshold=1.5)
    with pytest.raises(FitError, match="compares groups"):
        reach_decision({"late": late})


def _iso_spec(**kw) -> GridSpec:
    return GridSpec(
        name="iso_es",
        recipe="scalerl",
        axes=(Axis.of("sampling.n", [2, 8], short="n"),),
        base={"data.prompts_per_batch": 4},
        budget=Budget(amount=9600),  # n=2: 1200 steps, n=8: 300
        early_stop=EarlyStop(threshold=0.05, min_fraction=0.1, min_points=4),
        report=ReportSpec(kind="isocompute", x="rollouts"),
        **kw,
    )


def test_isocompute_grid_stops_a_run_only_once_it_cannot_reach_the_frontier():
    spec = _iso_spec()
    plans = expand(spec)
    by_n = {p.config.sampling.n: p for p in plans}
    truth = {2: (0.45, 300), 8: (0.8, 5000)}

    def rows(p, upto):
        n = p.config.sampling.n
        steps = np.arange(0, p.steps + 1, p.steps // 24)
        x = steps * n * 4.0
        y = sigmoid(x, r0=0.1, a=truth[n][0], b=1.5, c_mid=truth[n][1])
        y = y + 0.004 * np.cos(np.arange(x.size) * (n + 1))
        return [
            {"run_id": p.run_id, "step": int(s), "rollouts": float(xi), "val/pass@1": float(yi)}
            for s, xi, yi in zip(steps, x, y, strict=True)
            if xi <= upto
        ]

    check = early_stopper(spec, plans)
    done8 = rows(by_n[8], 9600)
    # n=2 at 20% of its budget: ahead of n=8 until C ~ 4800, so on the frontier. (Compared by
    # asymptotes, as compare grids are, n=2 (A = 0.45 vs 0.8) would be stopped here.)
    out = check({by_n[8].run_id: done8, by_n[2].run_id: rows(by_n[2], 1920)}, [by_n[2]])
    assert out == {}
    # At 60%, everything it has left lies below n=8's measured curve.
    out = check({by_n[8].run_id: done8, by_n[2].run_id: rows(by_n[2], 5760)}, [by_n[2]])
    assert set(out) == {by_n[2].run_id}
    assert out[by_n[2].run_id]["p"] < 0.05 and "frontier" in out[by_n[2].run_id]["reason"]


C_MAX = 1e5
CELLS = {
    (n, bp): {"r0": 0.1, "a": a + 0.03 * (bp == 16), "b": 1.5, "c_mid": c_mid}
    for n, (a, c_mid) in {32: (0.75, 3e4), 8: (0.60, 1e4), 2: (0.45, 3e3)}.items()
    for bp in (16, 4)
}
REPLAY = GridSpec(
    name="replay",
    recipe="isocompute",
    early_stop=EarlyStop(threshold=0.05, min_fraction=0.3),
    report=ReportSpec(kind="isocompute", x="rollouts"),
)


@pytest.fixture(scope="module")
def grid_rows():
    # Plan order: the largest n first, so the small ones are judged against it.
    return isocompute_rows(np.random.default_rng(0), CELLS, c_max=C_MAX)


@pytest.mark.parametrize("jobs", [2, 0])
def test_replay_stops_runs_that_cannot_reach_the_frontier_and_keeps_its_pick(grid_rows, jobs):
    rep = replay_early(REPLAY, grid_rows, jobs=jobs)
    stopped = {s["run"]: s for s in rep.stopped}
    # The n=2 cells are overtaken by n=8 at C ~ 2e4: past min_fraction nothing is left for them.
    assert {"n2_bp4", "n2_bp16"} <= set(stopped)
    assert "n32_bp16" not in stopped  # the frontier at the budget
    for s in stopped.values():  # no stopped cell was on the true frontier after its stop
        n, bp = (int(v.lstrip("nbp")) for v in s["run"].split("_"))
        c = np.linspace(s["at"], s["of"], 200)[1:]
        others = np.max([sigmoid(c, **p) for k, p in CELLS.items() if k != (n, bp)], axis=0)
        assert np.all(sigmoid(c, **CELLS[(n, bp)]) < others), s
        assert s["at"] >= 0.3 * s["of"] - 1e-9  # min_fraction
    assert rep.saved > 0.3
    assert rep.used == pytest.approx(
        rep.total - sum(s["of"] - s["at"] for s in rep.stopped), rel=1e-12
    )
    assert rep.picks and not rep.pick_changed
    top = max(rep.picks, key=lambda p: p["budget"])
    assert (top["full"]["n"], top["full"]["bp"]) == (32, 16)


def test_replay_keeps_cells_tied_with_the_frontier(grid_rows):
    # Every cell on one curve: each is on the frontier by noise (its evaluations set records),
    # so none can be said to fall short of it.
    same = {k: {"r0": 0.1, "a": 0.6, "b": 1.5, "c_mid": 1e4} for k in CELLS}
    rows = isocompute_rows(np.random.default_rng(1), same, c_max=C_MAX)
    rep = replay_early(REPLAY, rows, jobs=0)
    assert rep.stopped == () and rep.saved == 0.0 and not rep.pick_changed


def test_replay_on_a_compare_grid_keeps_the_top_recipe():
    # Compare grids (ScaleRL studies) stop by the leader's asymptote; the pick is the recipe
    # the ScaleRL rule ranks first.
    spec = GridSpec(
        name="cmp",
        recipe="scalerl",
        early_stop=EarlyStop(threshold=0.05, min_fraction=0.3),
        report=ReportSpec(kind="compare", x="rollouts"),
    )
    cells = {("good", 0): 0.7, ("bad", 0): 0.4, ("good", 1): 0.7, ("bad", 1): 0.4}
    rng = np.random.default_rng(0)
    rows = []
    for (name, seed), a in cells.items():
        x = np.linspace(0, 1e4, 13)
        y = sigmoid(x, r0=0.1, a=a, b=1.5, c_mid=2e3) + rng.normal(0, 0.004, x.size)
        rid = f"{name}-{seed}"
        rows += [
            {"run_id": rid, "group": name, "step": i, "rollouts": xi, "val/pass@1": yi}
            for i, (xi, yi) in enumerate(zip(x, y, strict=True))
        ]
    rep = replay_early(spec, rows, jobs=2)
    assert {s["group"] for s in rep.stopped} == {"bad"} and rep.saved > 0.2
    ((pick,),) = [rep.picks]
    assert pick["full"]["rank_1"] == pick["replay"]["rank_1"] == ["good"]
    assert not rep.pick_changed


SPEC = """
from rl_jax.grid import Axis, Budget, EarlyStop, GridSpec, ReportSpec

def grid():
    return GridSpec(
        name="replay_cli",
        recipe="isocompute",
        axes=(Axis.of("sampling.n", [2, 8, 32], short="n"),),
        budget=Budget(amount=100000),
        report=ReportSpec(kind="isocompute", x="rollouts"),
        early_stop={early_stop},
    )
"""


def _spec_file(tmp_path, early_stop="None"):
    p = tmp_path / "replay_cli.py"
    p.write_text(textwrap.dedent(SPEC.format(early_stop=early_stop)))
    return p


def test_cli_replays_recorded_curves(tmp_path, grid_rows, capsys):
    curves = tmp_path / "curves.jsonl"
    curves.write_text("".join(json.dumps(r) + "\n" for r in grid_rows))
    spec = _spec_file(tmp_path)
    args = ["grid", str(spec), "--replay-early", str(curves), "--out", str(tmp_path / "g")]
    assert main([*args, "--stop-early", "0.05", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "early-stop replay (2 at a time)" in out and "% saved" in out
    assert "stopped n2_bp4" in out and "the grid's pick unchanged" in out
    assert not (tmp_path / "g").exists()  # a replay runs and writes nothing
    # From OUT/<grid>/curves.jsonl, the spec's own early_stop, as JSON.
    (tmp_path / "g" / "replay_cli").mkdir(parents=True)
    (tmp_path / "g" / "replay_cli" / "curves.jsonl").write_text(curves.read_text())
    spec = _spec_file(tmp_path, "EarlyStop(threshold=0.05, min_fraction=0.3)")
    assert main(["grid", str(spec), "--replay-early", "--out", str(tmp_path / "g"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["saved"] > 0.3 and res["pick_changed"] is False and res["jobs"] == 1


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--stop-early", "0.7"], "early_stop.threshold=0.7"),
        (["--stop-early", "often"], "--stop-early 'often'"),
        (["--stop-early", "--no-early-stop"], "contradict"),
        ([], "pass --stop-early"),  # the spec has no early_stop
        (["--stop-early", "--jobs", "-1"], "--jobs=-1"),
    ],
)
def test_cli_bad_early_stop_input_exits_2(tmp_path, grid_rows, capsys, extra, needle):
    curves = tmp_path / "curves.jsonl"
    curves.write_text("".join(json.dumps(r) + "\n" for r in grid_rows[:40]))
    args = ["grid", str(_spec_file(tmp_path)), "--replay-early", str(curves), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err


def test_cli_replay_without_curves_exits_2(tmp_path, capsys):
    args = ["grid", str(_spec_file(tmp_path)), "--replay-early", "--stop-early"]
    assert main([*args, "--out", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "curves.jsonl" in err


def test_stop_early_turns_on_the_drivers_check(tmp_path, monkeypatch):
    import rl_jax.cli.grid as cli

    seen = {}

    class Recorder:
        def __init__(self, spec, plans, backend, **kw):
            seen.update(kw, spec=spec)

        def run(self):
            return {"done": 3}

    monkeypatch.setattr(cli, "Driver", Recorder)
    spec = _spec_file(tmp_path)  # no early_stop of its own
    args = [str(spec), "--out", str(tmp_path / "g"), "--no-report"]
    assert cli.main(args) == 0
    assert seen["early_stop"] is None
    assert cli.main([*args, "--stop-early", "0.02"]) == 0
    assert callable(seen["early_stop"]) and seen["spec"].early_stop.threshold == 0.02
    assert cli.main([*args, "--stop-early"]) == 0
    assert seen["spec"].early_stop == EarlyStop()  # the defaults


def test_a_changed_pick_says_whether_n_or_only_b_p_moved():
    from rl_jax.grid.replay import _changed

    full = {"n": 4.0, "bp": 16.0, "reward": 0.853}
    same_n = {"n": 4.0, "bp": 8.0, "reward": 0.848}
    assert "B_p only: the same n, cells 0.005 apart" in _changed(full, same_n, {})
    other_n = {"n": 2.0, "bp": 8.0, "reward": 0.86}
    assert "picks n = 2 in 37% of replicates" in _changed(
        full, other_n, {"p_full_picks_replay_n": 0.37}
    )
