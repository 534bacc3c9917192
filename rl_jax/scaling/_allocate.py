"""The compute-optimal allocation (n, B_p, M) for a budget, from a fitted iso-compute frontier.

IsoCompute (PAPERS.md section 2) spends a budget C = B_p * n * M: for a C, the frontier says
which n gives the most reward (`fit_frontier`), the grid's cells of that n say which B_p did
best at C, and M is what the budget leaves for one step of that cell. The interval comes from
bootstrapping every n's sigmoid: per replicate, the frontier's value at C and its argmax n.

Inside the fitted compute range each n's curve is held flat past the compute its runs reached
(as `fit_frontier` draws the frontier); outside it every n's sigmoid is extended to C, and
the allocation says it is an extrapolation and by what factor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rl_jax.scaling._bootstrap import _quantiles, bootstrap
from rl_jax.scaling._curves import Curve, knob_value
from rl_jax.scaling._early import _draw_curves
from rl_jax.scaling._isocompute import Frontier, FrontierError, _interp_log
from rl_jax.scaling._sigmoid import FitError, fit_sigmoid_runs


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One n at budget C: the frontier's value of its curve, and its best measured cell."""

    n: float
    bp: float  # the B_p whose runs of this n did best at C (at their reach, past it)
    steps: int | None  # M = C / (compute of one step of that cell); None if unknown
    reward: float  # this n's fitted curve at C
    interval: tuple[float, float]
    p_best: float  # share of bootstrap replicates in which this n is the frontier's argmax
    cell_reward: float  # the cell's measured best-so-far at C (nan below its first eval)
    runs: tuple[str, ...]  # run ids of the chosen cell


@dataclass(frozen=True, kw_only=True)
class Allocation:
    budget: float
    x: str  # the compute column C is counted in
    level: float
    fitted: tuple[float, float]  # compute range the frontier covers
    extrapolation: float  # 1 inside the fitted range; else C / its end (or its start / C)
    reward: float  # the frontier at C
    interval: tuple[float, float]  # bootstrap interval of the frontier at C
    # where one new run of the chosen cell should evaluate at C: the interval above widened by
    # the chosen n's evaluation noise (its fit's residual scale, Student-t)
    predictive: tuple[float, float]
    n_star_trend: float | None  # the fitted n*(C) sigmoid at C (a continuous trend)
    candidates: tuple[Candidate, ...]  # best predicted reward first
    notes: tuple[str, ...]

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_dict(self) -> dict:
        return {
            **{k: getattr(self, k) for k in ("budget", "x", "level", "reward", "extrapolation")},
            "fitted": list(self.fitted),
            "interval": list(self.interval),
            "predictive": list(self.predictive),
            "n_star_trend": self.n_star_trend,
            "candidates": [c.__dict__ | {"interval": list(c.interval)} for c in self.candidates],
            "notes": list(self.notes),
        }


def extrapolation_note(budget: float, fitted: tuple[float, float], x: str) -> tuple[float, str]:
    """(factor, sentence): how far C lies outside the fitted compute range (factor 1: inside)."""
    lo, hi = fitted
    if budget > hi:
        f = budget / hi
        return f, (
            f"EXTRAPOLATION: C = {budget:.4g} {x} is {f:.3g}x the largest compute fitted"
            f" ({hi:.4g}): every n's sigmoid is extended past its data"
        )
    if budget < lo:
        f = lo / budget
        return f, (
            f"EXTRAPOLATION: C = {budget:.4g} {x} is {f:.3g}x below the first evaluation fitted"
            f" ({lo:.4g}): the sigmoids are read where no run was measured"
        )
    return 1.0, ""


def _cells(curves: Sequence[Curve], fr: Frontier, budget: float) -> dict[float, list]:
    """n -> [(bp, measured reward at C, step cost, run ids)] over the grid's cells."""
    cells: dict[tuple[float, float], list[Curve]] = {}
    for c in curves:
        cells.setdefault((knob_value(c, fr.n_key), knob_value(c, fr.bp_key)), []).append(c)
    out: dict[float, list] = {}
    for (n, bp), runs in sorted(cells.items()):
        vals = []
        for c in runs:
            # Outside the cell's measurements: its nearest (the allocation says it extrapolates).
            first = float(c.x[c.x > 0].min()) if (c.x > 0).any() else math.inf
            v = _interp_log(c.x, c.y, min(max(budget, first), float(c.x.max())))
            if math.isfinite(v):
                vals.append(v)
        costs = [
            float(c.x[-1] / c.steps[-1]) for c in runs if c.steps is not None and c.steps[-1] > 0
        ]
        out.setdefault(n, []).append(
            (
                bp,
                float(np.mean(vals)) if vals else math.nan,
                float(np.median(costs)) if costs else math.nan,
                tuple(c.run_id for c in runs),
            )
        )
    return out


def _evaluation_noise(curves: Sequence[Curve], runs: tuple[str, ...], fallback) -> tuple:
    """(sigma, dof) of one evaluation of the chosen cell: the residuals of a sigmoid through
    its runs' own curves. The frontier's fit goes through best-so-far records, whose scatter
    understates how far one new evaluation falls from the curve."""
    pairs = [(c.x, c.y) for c in curves if c.run_id in runs]
    try:
        f = fit_sigmoid_runs(pairs)
    except FitError:
        f = fallback
    if not (math.isfinite(f.sigma) and f.dof > 0):
        f = fallback
    return f.sigma, f.dof


def _at(fr: Frontier, n: float, budget: float, factor: float) -> float:
    """Where n's curve is read for budget C: held at its reach inside the fitted range."""
    return budget if factor > 1 else min(budget, fr.ranges[n][1])


def _replicates(fr, budget, factor, *, n_boot, level, seed, notes) -> np.ndarray:
    """[len(fits), n_boot] every n's curve at C per bootstrap replicate (-inf where an n
    was never evaluated at so little compute)."""
    draws = []
    for i, n in enumerate(sorted(fr.fits)):
        at = _at(fr, n, budget, factor)
        try:
            bs = bootstrap(fr.fits[n], n_boot=n_boot, level=level, seed=seed + i)
            v = _draw_curves(bs, np.arange(bs.samples["A"].size), np.array([at]))[:, 0]
        except FitError as e:
            notes.append(f"n = {n:g}: no bootstrap ({e}); its interval is its point estimate")
            v = np.full(n_boot, float(fr.fits[n].predict(at)))
        if factor == 1 and budget < fr.ranges[n][0]:
            v = np.full_like(v, -np.inf)  # below its first evaluation an n says nothing
        draws.append(np.resize(v, n_boot))  # replicates that failed to refit are redrawn
    return np.stack(draws)


def _candidates(fr, cells, table, p_best, budget, factor, *, q, x, notes) -> list[Candidate]:
    """One candidate per n evaluated at the budget, best predicted reward first: the B_p
    of its best cell, the steps the budget buys, and its bootstrap interval (appends a note
    where one step costs more than the budget)."""
    cands = []
    for i, n in enumerate(sorted(fr.fits)):
        if not np.isfinite(table[i]).any():
            continue
        bp, cell_r, cost, runs = max(
            cells[n], key=lambda t: (t[1] if math.isfinite(t[1]) else -math.inf, -t[0])
        )
        steps = int(budget // cost) if math.isfinite(cost) and cost > 0 else None
        if steps == 0:
            notes.append(f"n = {n:g}, B_p = {bp:g}: one step ({cost:.4g} {x}) exceeds C")
        lo, hi = np.quantile(table[i], q)
        reward = float(fr.fits[n].predict(_at(fr, n, budget, factor)))
        cands.append(
            Candidate(
                n=n,
                bp=bp,
                steps=steps,
                reward=reward,
                interval=(float(lo), float(hi)),
                p_best=float(p_best[i]),
                cell_reward=cell_r,
                runs=runs,
            )
        )
    cands.sort(key=lambda c: -c.reward)
    return cands


def allocate(
    fr: Frontier,
    curves: Sequence[Curve],
    budget: float,
    *,
    x: str = "rollouts",
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
) -> Allocation:
    """The allocation at budget C (in the curves' compute `x`) with its bootstrap interval.

    curves: the runs `fr` was fitted on (their cells give B_p and the compute of a step)."""
    if not (isinstance(budget, int | float) and math.isfinite(budget) and budget > 0):
        raise FitError(f"budget {budget!r} must be a finite number > 0")
    fitted = (float(fr.c_grid[0]), float(fr.c_grid[-1]))
    factor, note = extrapolation_note(budget, fitted, x)
    notes = [note] if note else []
    ns = sorted(fr.fits)
    table = _replicates(fr, budget, factor, n_boot=n_boot, level=level, seed=seed, notes=notes)
    if not np.isfinite(table).any():
        raise FrontierError(f"no n of the frontier was evaluated at C = {budget:.4g} {x}")
    q = _quantiles(level)
    p_best = np.bincount(table.argmax(0), minlength=len(ns)) / table.shape[1]
    cells = _cells(curves, fr, budget)
    cands = _candidates(fr, cells, table, p_best, budget, factor, q=q, x=x, notes=notes)
    best = table.max(0)
    lo, hi = np.quantile(best, q)
    sigma, dof = _evaluation_noise(curves, cands[0].runs, fr.fits[cands[0].n])
    noisy = best[None, :] + sigma * np.random.default_rng(seed).standard_t(
        max(dof, 1), (20, best.size)
    )
    p_lo, p_hi = np.quantile(noisy, q) if math.isfinite(sigma) else (lo, hi)
    return Allocation(
        budget=float(budget),
        x=x,
        level=level,
        fitted=fitted,
        extrapolation=factor,
        reward=cands[0].reward,
        interval=(float(lo), float(hi)),
        predictive=(float(p_lo), float(p_hi)),
        n_star_trend=None if fr.n_star_fit is None else float(fr.n_star_at(budget)),
        candidates=tuple(cands),
        notes=tuple(notes),
    )
