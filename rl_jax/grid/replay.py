"""Early stopping replayed on a grid's recorded curves: the compute it saves, and whether the
frontier's pick moves.

The replay runs the driver's own check (`results.early_check`) over the curves as they
would have arrived: runs start in the grid's order, `jobs` at a time (all at once with
jobs=0), and each evaluation becomes visible once its run has spent its compute since it
started (time is counted in the report's compute unit, so a run's wall time is taken as
proportional to its compute). After every evaluation the check runs; a run it flags stops
right there (the driver stops it within `every_s`: the replay is the upper bound on the
saving) and its slot goes to the next run. The frontier is then fitted on the curves the
stopped grid would have kept and compared with the full grid's at its budgets.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rl_jax import scaling
from rl_jax.grid.results import GROUP_KEY, RunInfo, _fit_options, early_check, evaluations
from rl_jax.grid.spec import GridSpec
from rl_jax.knobs import ConfigError


@dataclass(frozen=True, kw_only=True)
class Replay:
    jobs: int
    total: float  # compute of every run to its last evaluation
    used: float  # compute with early stopping
    stopped: tuple[dict, ...]  # run, name, group, split, at (compute), of (its full), why
    # per split (and budget): the full grid's and the replay's pick, the frontier's
    # allocation for iso-compute grids, the recipes ranked first for others
    picks: tuple[dict, ...]
    notes: tuple[str, ...]

    @property
    def saved(self) -> float:
        return 1.0 - self.used / self.total if self.total > 0 else 0.0

    @property
    def pick_changed(self) -> bool:
        return any(p["changed"] for p in self.picks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "total": self.total,
            "used": self.used,
            "saved": self.saved,
            "pick_changed": self.pick_changed,
            "stopped": list(self.stopped),
            "picks": list(self.picks),
            "notes": list(self.notes),
        }


def _runs(spec: GridSpec, rows: Sequence[Mapping[str, Any]]):
    """Per run id in grid order: (RunInfo, its evaluation rows sorted by step)."""
    x, metric, split_by = spec.report.x, spec.report.metric, spec.report.split_by
    by_run: dict[str, list] = defaultdict(list)
    for r in rows:
        if "run_id" not in r:
            raise ConfigError("curve rows without run_id: replay needs a grid's curves.jsonl")
        by_run[str(r["run_id"])].append(r)
    out = {}
    for rid, rs in by_run.items():
        rs = evaluations(rs, x, metric)
        if not rs:
            continue
        if split_by and split_by not in rs[0]:
            raise ConfigError(
                f"curve rows of run {rid} have no {split_by!r} column (report.split_by);"
                " replay needs the grid's own curves.jsonl"
            )
        split = str(rs[0][split_by]) if split_by else "all"
        group = str(rs[0].get(GROUP_KEY) or rid)
        out[rid] = (RunInfo(group, split, int(rs[-1].get("step", 0))), rs)
    return out


def replay_early(spec: GridSpec, rows: Sequence[Mapping[str, Any]], *, jobs: int = 1) -> Replay:
    """Replay `spec.early_stop` on a grid's curve rows (curves.jsonl) with `jobs` at a time."""
    if spec.early_stop is None:
        raise ConfigError("replay needs an early_stop: pass --stop-early [THRESHOLD]")
    if jobs < 0:
        raise ConfigError(f"--jobs={jobs}: the replay runs jobs >= 1 at a time (0: all at once)")
    x = spec.report.x
    runs = _runs(spec, rows)
    if not runs:
        raise ConfigError(f"no curve rows with {x!r} and {spec.report.metric!r} to replay")
    notes = [
        f"{rid}: its curve stops at step {info.steps} ({rs[0].get('status')}); replayed as"
        " planned to end there"
        for rid, (info, rs) in runs.items()
        if rs[0].get("status") not in (None, "done")
    ]
    check = early_check(spec, {rid: info for rid, (info, _) in runs.items()})
    seen = _simulate(runs, check, x, jobs or len(runs))
    total = sum(float(rs[-1][x]) for _, rs in runs.values())
    used = sum(float(runs[rid][1][k - 1][x]) if k else 0.0 for rid, k in seen.counts.items())
    stopped = tuple(
        {
            "run": rid,
            "name": str(runs[rid][1][0].get("run_name") or rid),
            "group": runs[rid][0].group,
            "split": runs[rid][0].split,
            "at": float(runs[rid][1][seen.counts[rid] - 1][x]),
            "of": float(runs[rid][1][-1][x]),
            "why": why,
        }
        for rid, why in seen.stopped.items()
    )
    kept = [r for rid, (_, rs) in runs.items() for r in rs[: seen.counts[rid]]]
    full = [r for _, rs in runs.values() for r in rs]
    pick = _picks if spec.report.kind == "isocompute" else _ranking_picks
    picks = pick(spec, full, kept, runs)
    return Replay(
        jobs=jobs,
        total=total,
        used=used,
        stopped=stopped,
        picks=picks,
        notes=tuple(notes),
    )


@dataclass
class _Seen:
    counts: dict[str, int]  # run id -> evaluations visible (all of them once it has ended)
    stopped: dict[str, str]  # run id -> why


def _simulate(runs: dict, check, x: str, jobs: int) -> _Seen:
    """Event loop: evaluations in order of arrival, the check after each."""
    queue = list(runs)
    counts = {rid: 0 for rid in runs}
    stopped: dict[str, str] = {}
    running: dict[str, float] = {}  # run id -> its start time
    events: list[tuple[float, int, str]] = []  # (time, order, run id) of next evaluations
    order = 0

    def start(t: float) -> None:
        nonlocal order
        while queue and len(running) < jobs:
            rid = queue.pop(0)
            running[rid] = t
            heapq.heappush(events, (t + float(runs[rid][1][0][x]), order, rid))
            order += 1

    start(0.0)
    while events:
        t, _, rid = heapq.heappop(events)
        if rid not in running:
            continue  # stopped since this evaluation was scheduled
        rs = runs[rid][1]
        counts[rid] += 1
        if counts[rid] == len(rs):
            del running[rid]
        else:
            heapq.heappush(events, (running[rid] + float(rs[counts[rid]][x]), order, rid))
            order += 1
        visible = {r: runs[r][1][: counts[r]] for r in runs if counts[r]}
        for r, why in check(visible, list(running)).items():
            stopped[r] = why.get("reason", "")
            del running[r]
        start(t)
    return _Seen(counts=counts, stopped=stopped)


def _picks(spec: GridSpec, full: list, kept: list, runs: dict) -> tuple[dict, ...]:
    """Per split: the frontier's allocation at its budgets, fitted on all the curves and on
    those the stopped grid kept."""
    n_key, bp_key = spec.report.frontier
    x, metric = spec.report.x, spec.report.metric
    out = []
    for split in dict.fromkeys(info.split for info, _ in runs.values()):

        def of_split(rows, split=split):
            return [r for r in rows if runs[str(r["run_id"])][0].split == split]

        try:
            c_full = scaling.curves_from_rows(of_split(full), x=x, metric=metric, group_by=None)
            c_kept = scaling.curves_from_rows(of_split(kept), x=x, metric=metric, group_by=None)
            fr_full = scaling.fit_frontier(c_full, n_key=n_key, bp_key=bp_key)
            fr_kept = scaling.fit_frontier(c_kept, n_key=n_key, bp_key=bp_key)
        except scaling.FitError as e:
            out.append({"split": split, "budget": None, "changed": False, "note": str(e)})
            continue
        budgets = sorted({*fr_full.budgets, float(fr_full.c_grid[-1])})
        for b in budgets:
            a = scaling.allocate(fr_full, c_full, b, x=x, n_boot=50)
            k = scaling.allocate(fr_kept, c_kept, b, x=x, n_boot=50)
            full_pick, kept_pick = (a.best.n, a.best.bp), (k.best.n, k.best.bp)
            # How often the full grid's own bootstrap picks the replay's n: a change between
            # choices the full grid cannot tell apart is a tie, not a loss.
            p_tie = next((c.p_best for c in a.candidates if c.n == k.best.n), 0.0)
            out.append(
                {
                    "split": split,
                    "budget": b,
                    "full": {"n": full_pick[0], "bp": full_pick[1], "reward": a.reward},
                    "replay": {"n": kept_pick[0], "bp": kept_pick[1], "reward": k.reward},
                    "changed": full_pick != kept_pick,
                    "p_full_picks_replay_n": p_tie,
                }
            )
    return tuple(out)


def _ranking_picks(spec: GridSpec, full: list, kept: list, runs: dict) -> tuple[dict, ...]:
    """Per split of a compare grid: the recipe the ScaleRL rule ranks first (A within
    PAPER_A_TOL is a tie, broken by B), on all the curves and on those kept."""
    out = []
    for split in dict.fromkeys(info.split for info, _ in runs.values()):
        tops = []
        for rows in (full, kept):
            rows = [r for r in rows if runs[str(r["run_id"])][0].split == split]
            try:
                opts = {**_fit_options(spec), "extrapolate": None, "n_boot": 50}
                rep = scaling.fit_runs(rows, metric=spec.report.metric, **opts)
            except scaling.FitError as e:
                tops = None
                out.append({"split": split, "budget": None, "changed": False, "note": str(e)})
                break
            tops.append(sorted(r["recipe"] for r in rep.table if r["rank"] == 1))
        if tops is not None:
            out.append(
                {
                    "split": split,
                    "budget": None,
                    "full": {"rank_1": tops[0]},
                    "replay": {"rank_1": tops[1]},
                    "changed": tops[0] != tops[1],
                }
            )
    return tuple(out)


def _changed(full: dict, replay: dict, pick: dict) -> str:
    if full["n"] == replay["n"]:
        return (
            f"  CHANGED (B_p only: the same n, cells {abs(full['reward'] - replay['reward']):.3f}"
            " apart)"
        )
    return (
        f"  CHANGED (the full grid's bootstrap picks n = {replay['n']:g} in"
        f" {pick['p_full_picks_replay_n']:.0%} of replicates)"
    )


def format_replay(rep: Replay, unit: str) -> str:
    jobs = "all at once" if rep.jobs == 0 else f"{rep.jobs} at a time"
    lines = [
        f"early-stop replay ({jobs}): {rep.used:.4g} of {rep.total:.4g} {unit}"
        f" ({rep.saved:.1%} saved), {len(rep.stopped)} run(s) stopped",
    ]
    lines += [
        f"  stopped {s['name']} at {s['at']:.4g} of {s['of']:.4g}: {s['why']}" for s in rep.stopped
    ]
    for p in rep.picks:
        if "note" in p:
            lines.append(f"  {p['split']}: no pick to compare ({p['note']})")
            continue
        if p["budget"] is None:  # a compare grid: the recipes ranked first
            lines.append(
                f"  {p['split']}: ranked first on all curves {p['full']['rank_1']}, on those"
                f" kept {p['replay']['rank_1']}" + ("  CHANGED" if p["changed"] else "")
            )
            continue
        f, r = p["full"], p["replay"]
        lines.append(
            f"  {p['split']} at {p['budget']:.4g} {unit}: full grid n = {f['n']:g}, B_p ="
            f" {f['bp']:g} ({f['reward']:.3f}); replay n = {r['n']:g}, B_p = {r['bp']:g}"
            f" ({r['reward']:.3f})" + (_changed(f, r, p) if p["changed"] else "")
        )
    lines.append("the grid's pick " + ("CHANGED" if rep.pick_changed else "unchanged"))
    lines += [f"note: {n}" for n in rep.notes]
    return "\n".join(lines)
