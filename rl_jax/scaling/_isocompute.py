"""Iso-compute analysis (IsoCompute, PAPERS.md section 2).

For a grid of runs over n (rollouts per problem) and B_p (problems per batch),
with compute C = B_p * n * M:
1. record-breaking points: a point counts if its reward beats every point at
   lower compute (pooled over the runs of one n);
2. a monotone sigmoid per n through those points;
3. the compute-optimal frontier as their upper envelope, and n*(C) the n on it;
4. log2 n* fitted against log C with a sigmoid (n* grows, then saturates);
5. sensitivity: how much reward moves with n at fixed B_p versus with B_p at
   fixed n, at a few budgets.
Each n's sigmoid is used only from its first evaluation on, and held at its last
value past the compute its runs reached (a larger budget can always stop early):
the envelope compares measurements, never extrapolations, and never decreases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rl_jax.scaling._curves import Curve, CurveError, knob_value
from rl_jax.scaling._sigmoid import FitError, SigmoidFit, fit_sigmoid


class FrontierError(FitError):
    """The runs cannot give a frontier (e.g. a single run, or a single n)."""


def record_breaking(x, y) -> np.ndarray:
    """Mask of points whose y beats every point at strictly lower x (ties in x: the best one).

    Input order is kept; x need not be sorted (pooled runs)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise FitError(f"x and y must be 1-D of one length, got {x.shape} and {y.shape}")
    order = np.lexsort((-y, x))  # by x, best first within ties
    keep = np.zeros(x.size, dtype=bool)
    best = -np.inf
    prev_x = None
    for i in order:
        if x[i] == prev_x:
            continue  # only the best of a tie can be a record
        prev_x = x[i]
        if y[i] > best:
            keep[i] = True
            best = y[i]
    return keep


@dataclass(frozen=True, kw_only=True, eq=False)
class Frontier:
    n_key: str
    bp_key: str
    n_values: tuple[float, ...]
    bp_values: tuple[float, ...]
    fits: dict[float, SigmoidFit]  # n -> monotone sigmoid through its records
    fit_errors: dict[float, str]  # n -> why it has no sigmoid
    ranges: dict[float, tuple[float, float]]  # n -> compute its runs reached (> 0)
    records: dict[float, tuple[np.ndarray, np.ndarray]] = field(repr=False)
    c_grid: np.ndarray = field(repr=False)  # [G]
    envelope: np.ndarray = field(repr=False)  # [G] best fitted reward (nan: no n covers C)
    n_star: np.ndarray = field(repr=False)  # [G] the n achieving it
    n_star_fit: SigmoidFit | None  # log2 n* against C (sigmoid in log C)
    n_star_note: str | None
    budgets: tuple[float, ...]
    heat: dict[float, np.ndarray] = field(repr=False)  # budget -> [len(n), len(bp)] reward
    sensitivity: tuple[dict, ...]
    warnings: tuple[str, ...] = ()

    def n_star_at(self, c) -> np.ndarray:
        """The fitted n*(C) = 2 ** (log2 n* sigmoid); raises if the fit failed."""
        if self.n_star_fit is None:
            raise FrontierError(f"no n*(C) fit: {self.n_star_note}")
        return 2.0 ** self.n_star_fit.predict(c)

    def _per_n(self, n: float) -> dict:
        fit = self.fits.get(n)
        if fit is None:
            return {"error": self.fit_errors.get(n)}
        return {k: getattr(fit, k) for k in ("R0", "A", "B", "C_mid", "reliable")}

    def summary(self) -> dict:
        f = self.n_star_fit
        return {
            "n_key": self.n_key,
            "bp_key": self.bp_key,
            "n_values": list(self.n_values),
            "bp_values": list(self.bp_values),
            "per_n": {str(n): self._per_n(n) for n in self.n_values},
            "n_star_fit": None
            if f is None
            else {"log2_n_low": f.R0, "log2_n_high": f.A}
            | {k: getattr(f, k) for k in ("B", "C_mid", "r2", "reliable")},
            "n_star_note": self.n_star_note,
            "sensitivity": list(self.sensitivity),
            "warnings": list(self.warnings),
        }


def _interp_log(x: np.ndarray, y: np.ndarray, c: float) -> float:
    """The run's best-so-far reward at compute c (linear in log compute); nan outside."""
    pos = x > 0
    x, y = x[pos], np.maximum.accumulate(y)[pos]
    if x.size == 0 or c < x[0] or c > x[-1]:
        return math.nan
    return float(np.interp(math.log(c), np.log(x), y))


def _budgets(curves: Sequence[Curve], k: int) -> np.ndarray:
    """Up to k log-spaced budgets, each reached by at least two runs."""
    lo = [c.x[c.x > 0].min() for c in curves if (c.x > 0).any()]
    hi = [c.x.max() for c in curves]
    cand = np.geomspace(min(lo), max(hi), 64)
    cover = np.array([sum(a <= b <= h for a, h in zip(lo, hi, strict=True)) for b in cand])
    ok = cand[cover >= 2]
    if ok.size == 0:
        return ok
    idx = np.unique(np.round(np.linspace(0, ok.size - 1, min(k, ok.size))).astype(int))
    return ok[idx]


def fit_frontier(
    curves: Sequence[Curve],
    *,
    n_key: str = "sampling.n",
    bp_key: str = "data.prompts_per_batch",
    r0: str | float = "fit",
    method: str = "lsq",
    metric_range: tuple[float, float] = (0.0, 1.0),
    n_grid: int = 200,
    budgets: Sequence[float] | None = None,
) -> Frontier:
    """The compute-optimal frontier over n, n*(C), and the n-vs-B_p sensitivity.

    curves: one per run, with numeric `n_key` and `bp_key` knobs and x in a compute unit
    comparable across runs (IsoCompute counts rollouts). Raises FrontierError for a single
    run or a single n.
    """
    curves = list(curves)
    if len(curves) < 2:
        raise FrontierError(
            f"a frontier compares runs at different n; got {len(curves)} run(s). Run a grid over "
            f"{n_key} (and {bp_key})"
        )
    ns, bps, n_values, bp_values = _run_knobs(curves, n_key, bp_key)
    fits, errors, ranges, records, warnings = _fit_each_n(
        curves, ns, n_values, r0=r0, method=method, metric_range=metric_range
    )
    if len(fits) < 2:
        raise FrontierError(
            f"sigmoids could be fitted for {len(fits)} value(s) of {n_key}; need two. "
            f"Errors: {errors}"
        )
    c_grid, envelope, n_star, covered = _envelope(fits, ranges, n_grid)
    n_star_fit, note = _fit_n_star(c_grid[covered], n_star[covered], n_values)
    if budgets is None:
        budgets = _budgets(curves, 3)
    budgets = tuple(float(b) for b in budgets)
    heat, sens = {}, []
    for b in budgets:
        heat[b] = _heat(curves, ns, bps, n_values, bp_values, b)
        sens.append(_sensitivity(b, heat[b]))
    return Frontier(
        n_key=n_key,
        bp_key=bp_key,
        n_values=n_values,
        bp_values=bp_values,
        fits=fits,
        fit_errors=errors,
        ranges=ranges,
        records=records,
        c_grid=c_grid,
        envelope=envelope,
        n_star=n_star,
        n_star_fit=n_star_fit,
        n_star_note=note,
        budgets=budgets,
        heat=heat,
        sensitivity=tuple(sens),
        warnings=tuple(warnings),
    )


def _run_knobs(curves, n_key: str, bp_key: str):
    """(each run's n, each run's B_p, the n values, the B_p values); two n values at least."""
    try:
        ns = np.array([knob_value(c, n_key) for c in curves])
        bps = np.array([knob_value(c, bp_key) for c in curves])
    except CurveError as e:
        raise FrontierError(f"{e}; name the columns of n and B_p (--n-key, --bp-key)") from None
    n_values = tuple(sorted(set(ns.tolist())))
    bp_values = tuple(sorted(set(bps.tolist())))
    if len(n_values) < 2:
        raise FrontierError(
            f"all {len(curves)} runs have {n_key} = {n_values[0]:g}; a frontier over n needs "
            "at least two values"
        )
    return ns, bps, n_values, bp_values


def _fit_each_n(curves, ns, n_values, *, r0, method, metric_range):
    """Per n: the sigmoid through the record-breaking points of its runs pooled, the
    error where none fits, its compute range and records; and the warnings."""
    warnings: list[str] = []
    fits: dict[float, SigmoidFit] = {}
    errors: dict[float, str] = {}
    ranges: dict[float, tuple[float, float]] = {}
    records: dict[float, tuple[np.ndarray, np.ndarray]] = {}
    for n in n_values:
        group = [c for c, cn in zip(curves, ns, strict=True) if cn == n]
        x = np.concatenate([c.x for c in group])
        y = np.concatenate([c.y for c in group])
        keep = record_breaking(x, y)
        order = np.argsort(x[keep], kind="stable")
        xr, yr = x[keep][order], y[keep][order]
        records[n] = (xr, yr)
        pos = x[x > 0]
        ranges[n] = (float(pos.min()) if pos.size else math.nan, float(x.max()))
        try:
            f = fit_sigmoid(xr, yr, r0=r0, method=method, metric_range=metric_range)
        except FitError as e:
            errors[n] = str(e)
            warnings.append(f"n = {n:g}: no sigmoid ({e})")
            continue
        fits[n] = f
        if not f.reliable:
            warnings.append(f"n = {n:g}: sigmoid unreliable ({'; '.join(f.warnings)})")
    return fits, errors, ranges, records, warnings


def _envelope(fits, ranges, n_grid: int):
    """(compute grid, best predicted reward on it, the n that reaches it, where any n
    covers the compute) over the fitted n's compute range."""
    lo = min(r[0] for n, r in ranges.items() if n in fits)
    hi = max(r[1] for n, r in ranges.items() if n in fits)
    c_grid = np.geomspace(lo, hi, n_grid)
    cols = []
    fit_ns = sorted(fits)
    for n in fit_ns:
        # Below its first evaluation an n says nothing; past its last, a budget C can still buy
        # what that n reached (stop early), so its curve is held flat: the frontier, the best
        # reward for compute <= C, never falls.
        lo_n, hi_n = ranges[n]
        v = fits[n].predict(np.minimum(c_grid, hi_n))
        v[c_grid < lo_n] = np.nan
        cols.append(v)
    table = np.stack(cols, axis=1)  # [G, n]
    covered = np.isfinite(table).any(1)
    envelope = np.full(c_grid.size, np.nan)
    n_star = np.full(c_grid.size, np.nan)
    best = np.nanargmax(np.where(np.isfinite(table), table, -np.inf), axis=1)
    envelope[covered] = table[covered, best[covered]]
    n_star[covered] = np.array(fit_ns)[best[covered]]
    return c_grid, envelope, n_star, covered


def _heat(curves, ns, bps, n_values, bp_values, budget: float) -> np.ndarray:
    """[n, B_p] mean reward of each cell's runs at compute `budget` (NaN where none reached)."""
    mat = np.full((len(n_values), len(bp_values)), np.nan)
    acc: dict[tuple[int, int], list[float]] = {}
    for c, cn, cb in zip(curves, ns, bps, strict=True):
        v = _interp_log(c.x, c.y, budget)
        if math.isfinite(v):
            acc.setdefault((n_values.index(cn), bp_values.index(cb)), []).append(v)
    for (i, j), vals in acc.items():
        mat[i, j] = float(np.mean(vals))  # seeds of one cell averaged
    return mat


def _fit_n_star(c: np.ndarray, n_star: np.ndarray, n_values) -> tuple[SigmoidFit | None, str]:
    """log2 n* = L0 + (L1 - L0) / (1 + (C_mid / C)^B), bounded by the n values tried.

    The points are a staircase sampled on a compute grid, not independent evaluations: the
    fit describes the trend; its R^2 is not a test."""
    logn = np.log2(n_star)
    lo, hi = math.log2(min(n_values)), math.log2(max(n_values))
    if np.unique(logn).size < 2:
        return None, (
            f"n* = {2 ** logn[0]:g} over the whole compute range: no trend to fit "
            "(the frontier never switches n)"
        )
    try:
        fit = fit_sigmoid(c, logn, r0="fit", method="lsq", metric_range=(lo, hi))
    except FitError as e:
        return None, str(e)
    note = "staircase of n* on a compute grid; R^2 describes the trend, it is not a test"
    if fit.A < fit.R0:
        note += "; n* decreases with compute here"
    return fit, note


def _spread(v: np.ndarray) -> float:
    """The range of v's finite values; NaN with fewer than two."""
    v = v[np.isfinite(v)]
    return float(v.max() - v.min()) if v.size >= 2 else math.nan


def _sensitivity(budget: float, mat: np.ndarray) -> dict:
    """Mean reward range across n at fixed B_p, and across B_p at fixed n."""

    def spread(m):
        rng = [s for s in map(_spread, m) if not math.isnan(s)]
        return (float(np.mean(rng)) if rng else math.nan), len(rng)

    by_n, k_n = spread(mat.T)  # for each B_p (column), range over n
    by_bp, k_bp = spread(mat)  # for each n (row), range over B_p
    mean = float(np.nanmean(mat)) if np.isfinite(mat).any() else math.nan
    return {
        "budget": budget,
        "reward_range_over_n": by_n,
        "reward_range_over_bp": by_bp,
        "relative_over_n": by_n / mean if mean else math.nan,
        "relative_over_bp": by_bp / mean if mean else math.nan,
        "bp_columns_used": k_n,
        "n_rows_used": k_bp,
        "runs_covering": int(np.isfinite(mat).sum()),
    }
