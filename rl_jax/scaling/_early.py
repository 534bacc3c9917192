"""Early decision: which partial runs can still beat the leader's asymptote?

Given each recipe's (partial) curve fit and its bootstrap distribution of A,
the probability that a recipe's asymptote beats the current leader's is
P(A_i > A_leader + margin) with the two distributions independent (separate
runs). A grid can stop a recipe once that probability falls below a threshold.

A curve that has not bent yet has a wide bootstrap distribution of A (often
reaching the metric's maximum), so its probability stays high and it is not
stopped: uncertainty protects young runs rather than condemning them.

For an iso-compute grid, `reach_decision` asks the question that matters there:
will a run ever lie on the compute-optimal frontier in the compute it has left?
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy import special

from rl_jax.scaling._bootstrap import Bootstrap, bootstrap
from rl_jax.scaling._sigmoid import FitError, SigmoidFit


@dataclass(frozen=True, kw_only=True)
class EarlyRow:
    name: str
    A: float
    A_interval: tuple[float, float]
    p_beats_leader: float | None  # None for the leader itself
    p_best: float  # probability of having the highest A of all recipes
    stop: bool
    reliable: bool


@dataclass(frozen=True, kw_only=True)
class EarlyDecision:
    leader: str
    threshold: float
    margin: float
    rows: tuple[EarlyRow, ...]

    def to_dict(self) -> dict:
        rows = [r.__dict__ | {"A_interval": list(r.A_interval)} for r in self.rows]
        return self.__dict__ | {"rows": rows}


def p_greater(a: np.ndarray, b: np.ndarray, margin: float = 0.0) -> float:
    """P(a > b + margin) for independent draws from two samples; ties count one half
    (both at the metric's maximum, say)."""
    a = np.asarray(a, dtype=float)
    b = np.sort(np.asarray(b, dtype=float) + margin)
    below = np.searchsorted(b, a, side="left")
    at_or_below = np.searchsorted(b, a, side="right")
    return float(np.mean((below + at_or_below) / 2) / b.size)


def _boots(fits, what: str, threshold: float, n_boot: int, seed: int) -> dict[str, Bootstrap]:
    """{name: its Bootstrap}, a SigmoidFit bootstrapped over its residuals (seed + its
    index); checks that there are two names at least and that threshold is in (0, 1)."""
    if len(fits) < 2:
        raise FitError(f"{what}; got {len(fits)}")
    if not 0 < threshold < 1:
        raise FitError(f"threshold={threshold!r} must be in (0, 1)")
    return {
        k: f if isinstance(f, Bootstrap) else bootstrap(f, n_boot=n_boot, seed=seed + i)
        for i, (k, f) in enumerate(fits.items())
    }


def early_decision(
    recipes: Mapping[str, Bootstrap | SigmoidFit],
    *,
    threshold: float = 0.05,
    margin: float = 0.0,
    n_boot: int = 200,
    seed: int = 0,
) -> EarlyDecision:
    """Per recipe: P(its A beats the leader's A + margin), P(it has the highest A), and
    whether to stop it (probability below threshold). The leader has the highest fitted A
    among reliable fits (among all when none is reliable).

    recipes: name -> Bootstrap, or a SigmoidFit (then bootstrapped over its residuals).
    """
    boots = _boots(recipes, "an early decision compares recipes", threshold, n_boot, seed)
    # The leader is the best *established* asymptote: an unreliable fit (a curve that has not
    # bent, say) may report a high A that nothing supports yet.
    pool = [k for k in boots if boots[k].fit.reliable] or list(boots)
    leader = max(pool, key=lambda k: boots[k].fit.A)
    a_lead = boots[leader].samples["A"]
    rng = np.random.default_rng(seed)
    draws = 4000
    names = list(boots)
    joint = np.stack([rng.choice(boots[k].samples["A"], size=draws) for k in names])  # [R, D]
    # Ties (e.g. several at the metric's maximum) are shared out evenly.
    top = joint == joint.max(0, keepdims=True)
    p_best = (top / top.sum(0, keepdims=True)).mean(1)
    rows = []
    for k, pb in zip(names, p_best, strict=True):
        bs = boots[k]
        p = None if k == leader else p_greater(bs.samples["A"], a_lead, margin)
        rows.append(
            EarlyRow(
                name=k,
                A=bs.fit.A,
                A_interval=bs.interval("A"),
                p_beats_leader=p,
                p_best=float(pb),
                stop=p is not None and p < threshold,
                reliable=bs.fit.reliable,
            )
        )
    rows.sort(key=lambda r: -r.A)
    return EarlyDecision(leader=leader, threshold=threshold, margin=margin, rows=tuple(rows))


# ---- reaching the frontier (IsoCompute grids) -------------------------------------------
#
# In an iso-compute grid every run has its own budget and the question is not whose asymptote
# is highest but whether a run will ever lie on the compute-optimal frontier (PAPERS.md
# section 2): the frontier is made of record-breaking evaluations, so a run none of whose
# remaining evaluations can beat the others' curves adds nothing to it, and the rest of its
# budget is wasted.


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A group of runs (one grid cell, its seeds pooled) part-way through its budget."""

    fit: Bootstrap | SigmoidFit
    first: float  # compute of its first evaluation after the base model's (> 0)
    reached: float  # compute measured so far
    end: float  # compute it is planned to reach
    every: float = 0.0  # compute between its evaluations (0: from the fitted points)


@dataclass(frozen=True, kw_only=True)
class ReachRow:
    name: str
    p_reach: float | None  # None: finished, nothing left to decide
    stop: bool
    reached: float
    end: float
    reliable: bool


@dataclass(frozen=True, kw_only=True)
class ReachDecision:
    threshold: float
    margin: float
    rows: tuple[ReachRow, ...]

    def to_dict(self) -> dict:
        return self.__dict__ | {"rows": [r.__dict__ for r in self.rows]}


def _draw_curves(bs: Bootstrap, idx: np.ndarray, c: np.ndarray) -> np.ndarray:
    """[len(idx), len(c)] the bootstrap replicates `idx` of a curve at compute c."""
    s = {k: v[idx][:, None] for k, v in bs.samples.items()}
    with np.errstate(divide="ignore"):
        u = np.log(c)[None, :]
    return s["R0"] + (s["A"] - s["R0"]) * special.expit(s["B"] * (u - np.log(s["C_mid"])))


def _future(g: Progress) -> np.ndarray:
    """The compute of a group's remaining evaluations, spaced as its past ones, the last at
    its end."""
    every = g.every
    if not every > 0:
        x = np.unique(g.fit.x if isinstance(g.fit, SigmoidFit) else g.fit.fit.x)
        every = float(np.median(np.diff(x))) if x.size > 1 else g.end - g.reached
    k = max(1, int(np.ceil((g.end - g.reached) / every - 1e-9)))
    return np.minimum(g.reached + every * np.arange(1, k + 1), g.end)


def _p_reach(groups, boots, live, *, margin: float, draws: int, seed: int) -> dict[str, float]:
    """{live group: P(one of its remaining evaluations beats the others' frontier by margin)}
    (see reach_decision)."""
    names = list(groups)
    # Every group's replicates on the union of the live groups' future evaluations.
    c = np.unique(np.concatenate(list(live.values())))
    rng = np.random.default_rng(seed)
    curves, measured = {}, []
    for k in names:
        g, bs = groups[k], boots[k]
        idx = rng.integers(0, bs.samples["A"].size, draws)
        both = _draw_curves(bs, idx, np.append(c, g.reached))
        cur, flat = both[:, :-1], both[:, -1:]
        held = np.where(c[None, :] > g.reached, flat, cur)
        measured.append(np.where(c[None, :] < g.first, -np.inf, held))
        curves[k] = cur
    m = np.stack(measured)  # [G, D, C]
    # The bar for group i is the best of the others: the top value unless i holds it.
    order = np.argsort(-m, axis=0)[:2]
    top, second = np.take_along_axis(m, order, axis=0)
    p_reach = {}
    for i, k in enumerate(names):
        if k not in live:
            continue
        at = np.searchsorted(c, live[k])
        bar = np.where(order[0] == i, second, top)[:, at]
        sigma = boots[k].fit.sigma if np.isfinite(boots[k].fit.sigma) else 0.0
        evals = curves[k][:, at] + sigma * rng.standard_normal((draws, at.size))
        p_reach[k] = float((evals > bar + margin).any(axis=1).mean())
    return p_reach


def reach_decision(
    groups: Mapping[str, Progress],
    *,
    threshold: float = 0.05,
    margin: float = 0.0,
    n_boot: int = 200,
    draws: int = 200,
    seed: int = 0,
) -> ReachDecision:
    """Per unfinished group: P(one of its remaining evaluations beats the frontier of the
    others by `margin`), and whether to stop it (probability below threshold).

    The frontier is drawn as `fit_frontier` draws it: each other group's curve from its first
    evaluation on, held flat past the compute it has reached, so it compares measurements,
    never another run's extrapolation. The candidate's evaluations are its fit extrapolated
    to its planned end plus its evaluation noise (the fit's residual scale): a group tied
    with the frontier sets records by noise, and is kept. Curves come from bootstrap
    replicates drawn independently (separate runs), so a young curve, whose replicates
    spread wide, is rarely stopped. Where no other group has been measured the candidate
    counts as reaching the frontier.
    """
    fits = {k: g.fit for k, g in groups.items()}
    boots = _boots(fits, "reaching a frontier compares groups", threshold, n_boot, seed)
    live = {k: _future(g) for k, g in groups.items() if g.reached < g.end}
    rows = {
        k: ReachRow(
            name=k,
            p_reach=None,
            stop=False,
            reached=g.reached,
            end=g.end,
            reliable=boots[k].fit.reliable,
        )
        for k, g in groups.items()
    }
    if live:
        for k, p in _p_reach(groups, boots, live, margin=margin, draws=draws, seed=seed).items():
            rows[k] = dataclasses.replace(rows[k], p_reach=p, stop=p < threshold)
    return ReachDecision(threshold=threshold, margin=margin, rows=tuple(rows.values()))
