"""An iso-compute study: the frontier per split, and the IsoCompute paper's findings tested.

`fit_frontier` gives each split's compute-optimal frontier, n*(C) and the reward of every
(n, B_p) cell at a few budgets (each run's best-so-far evaluation at that compute). This
module asks of them what IsoCompute (PAPERS.md section 2) reports, with intervals:

- **n against B_p at fixed budget.** Per budget, the cells' rewards are fitted by a
  two-way additive model, reward = mu + alpha_n + beta_Bp (least squares over the cells
  that reached the budget). The reward moved by n is the range of alpha over n, by B_p the
  range of beta over B_p (for a full grid: the range of the row means and of the column
  means). With one run per cell, the model's residuals are the noise (seed noise and
  interaction together, Tukey's design without replication): a residual bootstrap
  (fitted + resampled residuals scaled by sqrt(cells / residual dof), refitted) gives
  percentile intervals for both ranges and their difference.
- **fixed total batch B = B_p x n.** Per budget, along every B with at least two cells,
  the reward of the cell with the largest n minus that of the cell with the largest B_p,
  averaged over those B (positive: larger n wins at that M = C / B); intervals from the
  same bootstrap replicates.
- **n* against the budget.** The frontier's n* at the smallest and largest budget, and the
  bootstrap of each n's sigmoid (the replicates `rl-jax allocate` uses): per replicate the
  frontier's argmax at both budgets, hence P(n* grows) and P(n* shrinks). These intervals
  come from the scatter of the record-breaking evaluations, not from seeds.
- **interference.** Per n (its B_p cells pooled), the histogram of the latest training
  pass rate of every problem seen, at each run's last evaluation
  (`train/pass_rate_hist`): the shares of problems near 0 and near 1, which n's
  quantization shapes (n = 2 shows 0, 0.5 or 1 only), and the polarization, which it
  does not: the share of the rates' variance that lies between problems once the
  binomial noise of n samples is taken out (`polarization`), with a bootstrap over
  problems. "Rich get richer" is a high polarization at small n.

Every number comes from deterministic code (fixed seeds), so a study's report regenerates
bit for bit from its curves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rl_jax.scaling._allocate import _replicates
from rl_jax.scaling._bootstrap import _quantiles
from rl_jax.scaling._curves import CurveError, curves_from_rows
from rl_jax.scaling._isocompute import Frontier, FrontierError, _spread, fit_frontier
from rl_jax.scaling._sigmoid import FitError

HIST_KEY = "train/pass_rate_hist"


@dataclass(frozen=True, kw_only=True)
class Effects:
    """The additive model's answer at one budget; intervals are bootstrap percentiles."""

    budget: float
    cells: int
    dof: int  # residual degrees of freedom
    resid_sd: float
    mean: float  # mean reward of the cells
    over_n: float  # range of alpha over n
    over_bp: float  # range of beta over B_p
    diff: float  # over_n - over_bp
    over_n_interval: tuple[float, float]
    over_bp_interval: tuple[float, float]
    diff_interval: tuple[float, float]
    fixed_batch: float  # mean over B of reward(largest n) - reward(largest B_p); nan: no B
    fixed_batch_interval: tuple[float, float]
    fixed_batch_sizes: tuple[float, ...]  # the B values compared
    # [n_boot, 4] replicates of (over_n, over_bp, diff, fixed_batch)
    draws: np.ndarray = field(repr=False, compare=False)


@dataclass(frozen=True, kw_only=True)
class NStar:
    """n* at the smallest and largest budget, with the bootstrap's distribution of each."""

    lo_budget: float
    hi_budget: float
    lo: float  # the frontier's n* at lo_budget
    hi: float
    p_lo: dict[float, float]  # n -> share of replicates with n* = n at lo_budget
    p_hi: dict[float, float]
    p_grows: float  # share of replicates with n*(hi) > n*(lo)
    p_shrinks: float
    draws_hi: np.ndarray = field(repr=False)  # [n_boot] n*(hi) per replicate


@dataclass(frozen=True, kw_only=True, eq=False)
class SplitStudy:
    split: str
    runs: int
    frontier: Frontier
    effects: tuple[Effects, ...]
    n_star: NStar | None
    interference: tuple[dict[str, Any], ...]  # per n
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, eq=False)
class IsoStudy:
    x: str
    metric: str
    level: float
    n_boot: int
    splits: dict[str, SplitStudy]


def additive_fit(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(alpha [rows], beta [cols], fitted [rows, cols], residual dof) of the least-squares
    two-way additive model over the finite cells of `mat` (nan elsewhere; alpha and beta
    are nan for rows or columns without a cell, and relative to the first one present)."""
    ii, jj = np.nonzero(np.isfinite(mat))
    rows, cols = np.unique(ii), np.unique(jj)
    ri = {r: k for k, r in enumerate(rows)}
    ci = {c: k for k, c in enumerate(cols)}
    p = 1 + (rows.size - 1) + (cols.size - 1)
    X = np.zeros((ii.size, p))
    X[:, 0] = 1.0
    for k, (i, j) in enumerate(zip(ii, jj, strict=True)):
        if ri[i]:
            X[k, ri[i]] = 1.0
        if ci[j]:
            X[k, rows.size - 1 + ci[j]] = 1.0
    coef, *_ = np.linalg.lstsq(X, mat[ii, jj], rcond=None)
    alpha = np.full(mat.shape[0], np.nan)
    beta = np.full(mat.shape[1], np.nan)
    alpha[rows] = np.concatenate([[0.0], coef[1 : rows.size]])
    beta[cols] = np.concatenate([[0.0], coef[rows.size :]])
    fitted = np.full(mat.shape, np.nan)
    fitted[ii, jj] = X @ coef
    return alpha, beta, fitted, int(ii.size - np.linalg.matrix_rank(X))


def percentile_interval(draws: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval of bootstrap draws, non-finite ones dropped (nan, nan
    without any)."""
    d = np.asarray(draws, dtype=float)
    d = d[np.isfinite(d)]
    return tuple(float(v) for v in np.quantile(d, _quantiles(level))) if d.size else (math.nan,) * 2


def fixed_batch(mat: np.ndarray, n_values, bp_values) -> tuple[float, tuple[float, ...]]:
    """(mean over batch sizes B of reward(largest n) - reward(largest B_p), the B used):
    only B = n x B_p with two cells or more that reached the budget count."""
    diag: dict[float, list[tuple[float, float]]] = {}
    for (i, j), v in np.ndenumerate(mat):
        if math.isfinite(v):
            diag.setdefault(n_values[i] * bp_values[j], []).append((n_values[i], v))
    diffs, sizes = [], []
    for b, cells in sorted(diag.items()):
        if len(cells) >= 2:
            cells.sort()
            diffs.append(cells[-1][1] - cells[0][1])  # largest n minus largest B_p
            sizes.append(b)
    return (float(np.mean(diffs)) if diffs else math.nan), tuple(sizes)


def _stats(mat, n_values, bp_values) -> np.ndarray:
    alpha, beta, _, _ = additive_fit(mat)
    over_n, over_bp = _spread(alpha), _spread(beta)
    return np.array([over_n, over_bp, over_n - over_bp, fixed_batch(mat, n_values, bp_values)[0]])


def effects_at(
    budget: float, mat: np.ndarray, n_values, bp_values, *, n_boot: int, level: float, seed: int
) -> Effects | None:
    """The additive model at one budget and its residual bootstrap; None with fewer than
    one residual degree of freedom (nothing to estimate the noise from)."""
    ok = np.isfinite(mat)
    if ok.sum() < 3:
        return None
    _, _, fitted, dof = additive_fit(mat)
    if dof < 1:
        return None
    resid = (mat - fitted)[ok]
    scaled = resid * math.sqrt(resid.size / dof)
    rng = np.random.default_rng(seed)
    reps = []
    for _ in range(n_boot):
        m = np.full(mat.shape, np.nan)
        m[ok] = fitted[ok] + rng.choice(scaled, size=resid.size, replace=True)
        reps.append(_stats(m, n_values, bp_values))
    reps = np.array(reps)

    def interval(k):
        return percentile_interval(reps[:, k], level)

    point = _stats(mat, n_values, bp_values)
    return Effects(
        budget=float(budget),
        cells=int(ok.sum()),
        dof=dof,
        resid_sd=float(math.sqrt((resid**2).sum() / dof)),
        mean=float(mat[ok].mean()),
        over_n=float(point[0]),
        over_bp=float(point[1]),
        diff=float(point[2]),
        over_n_interval=interval(0),
        over_bp_interval=interval(1),
        diff_interval=interval(2),
        fixed_batch=float(point[3]),
        fixed_batch_interval=interval(3),
        fixed_batch_sizes=fixed_batch(mat, n_values, bp_values)[1],
        draws=reps,
    )


def n_star_change(fr: Frontier, *, n_boot: int, level: float, seed: int) -> NStar | None:
    """n* at the frontier's smallest and largest budget, and how often it grows or shrinks
    across the bootstrap replicates of every n's sigmoid (the same replicates at both)."""
    if len(fr.budgets) < 2:
        return None
    lo_b, hi_b = fr.budgets[0], fr.budgets[-1]
    ns = np.array(sorted(fr.fits))
    notes: list[str] = []
    draws = []
    for b in (lo_b, hi_b):
        table = _replicates(fr, b, 1.0, n_boot=n_boot, level=level, seed=seed, notes=notes)
        draws.append(ns[table.argmax(0)])
    lo, hi = draws

    def share(d):
        return {float(n): float(np.mean(d == n)) for n in ns}

    return NStar(
        lo_budget=float(lo_b),
        hi_budget=float(hi_b),
        lo=_frontier_n_star(fr, lo_b),
        hi=_frontier_n_star(fr, hi_b),
        p_lo=share(lo),
        p_hi=share(hi),
        p_grows=float(np.mean(hi > lo)),
        p_shrinks=float(np.mean(hi < lo)),
        draws_hi=hi,
    )


def _frontier_n_star(fr: Frontier, budget: float) -> float:
    """The n on the frontier at `budget` (the compute grid's nearest point)."""
    k = int(np.argmin(np.abs(np.log(fr.c_grid) - math.log(budget))))
    return float(fr.n_star[k])


def _bin_values(n: int, bins: int) -> np.ndarray:
    """Per histogram bin, the mean of the pass rates k / n a group of n can show that fall
    in it (binned as the trainer bins them); the bin's middle where none does."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    vals = np.arange(n + 1) / n
    count, _ = np.histogram(vals, bins=edges)
    total, _ = np.histogram(vals, bins=edges, weights=vals)
    middle = (edges[:-1] + edges[1:]) / 2
    return np.where(count > 0, total / np.maximum(count, 1), middle)


def polarization(counts: np.ndarray, n: int) -> tuple[float, float]:
    """(mean pass rate, the share of the pass rates' variance that lies between problems):
    each problem's observed rate is Binomial(n, p_i) / n, whose variance is Var(p) plus
    E[p (1 - p)] / n, so Var(p) = (Var(r) - m (1 - m) / n) / (1 - 1 / n), divided here by
    its largest value m (1 - m) (every problem at 0 or 1). 1: problems all-or-nothing
    ("rich get richer"); 0: every problem at the mean. Rates are taken per bin (exact for
    n <= 8 with 10 bins; within a bin's width of 0.1 otherwise)."""
    c = np.asarray(counts, dtype=float)
    v = _bin_values(int(n), c.size)
    total = c.sum()
    m = float((c * v).sum() / total)
    var = float((c * (v - m) ** 2).sum() / total)
    spread = m * (1.0 - m)
    if n < 2 or spread <= 0:
        return m, math.nan
    return m, (var - spread / n) / ((1.0 - 1.0 / n) * spread)


def _trajectory(rows, n_key: str, x: str, n: float, runs: int) -> list[list[float]]:
    """[[compute, polarization]] of n's runs pooled, at each compute where every one of
    its `runs` runs logged a histogram (the diagnostic over training)."""
    at: dict[float, list] = {}
    for r in rows:
        if float(r[n_key]) == n and r.get(x) is not None:
            at.setdefault(float(r[x]), []).append(np.asarray(r[HIST_KEY], dtype=float))
    return [
        [c, polarization(np.sum(hs, axis=0), int(n))[1]]
        for c, hs in sorted(at.items())
        if len(hs) == runs and c > 0
    ]


def interference(
    rows: Sequence[Mapping[str, Any]],
    n_key: str,
    *,
    x: str = "rollouts",
    n_boot: int,
    level: float,
    seed: int,
) -> tuple[dict[str, Any], ...]:
    """Per n: the pooled histogram of the latest per-problem training pass rate at each
    run's last evaluation that logged one, its shares of problems near 0 and near 1, its
    polarization with a bootstrap interval (problems resampled), and the polarization at
    each compute `x` all its runs were evaluated at."""
    rows = [r for r in rows if r.get(HIST_KEY) is not None and sum(r[HIST_KEY]) > 0]
    last: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        rid = str(r.get("run_id"))
        if rid not in last or r.get("step", 0) >= last[rid].get("step", 0):
            last[rid] = r
    by_n: dict[float, np.ndarray] = {}
    runs: dict[float, int] = {}
    for r in last.values():
        n = float(r[n_key])
        by_n[n] = by_n.get(n, 0) + np.asarray(r[HIST_KEY], dtype=float)
        runs[n] = runs.get(n, 0) + 1
    rng = np.random.default_rng(seed)
    q = _quantiles(level)
    out = []
    for n in sorted(by_n):
        h = by_n[n]
        mean, pol = polarization(h, int(n))
        draws = [polarization(d, int(n))[1] for d in rng.multinomial(h.sum(), h / h.sum(), n_boot)]
        out.append(
            {
                "n": n,
                "runs": runs[n],
                "problems": int(h.sum()),
                "share": [float(v) for v in h / h.sum()],
                "near_zero": float(h[0] / h.sum()),
                "near_one": float(h[-1] / h.sum()),
                "mean_pass": mean,
                "polarization": pol,
                "polarization_interval": [float(v) for v in np.quantile(draws, q)],
                "draws": np.asarray(draws),
                "over_training": _trajectory(rows, n_key, x, n, runs[n]),
            }
        )
    return tuple(out)


def analyse_split(
    name: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    x: str,
    metric: str,
    n_key: str,
    bp_key: str,
    group_by: str,
    n_boot: int,
    level: float,
    seed: int = 0,
) -> SplitStudy:
    """The frontier of one split's runs, its effects per budget, n*'s change, interference."""
    curves = curves_from_rows(rows, x=x, metric=metric, group_by=group_by)
    fr = fit_frontier(curves, n_key=n_key, bp_key=bp_key)
    effects, notes = [], []
    for k, b in enumerate(fr.budgets):
        e = effects_at(
            b, fr.heat[b], fr.n_values, fr.bp_values, n_boot=n_boot, level=level, seed=seed + k
        )
        if e is None:
            notes.append(f"budget {b:.4g}: too few cells for the additive model's noise")
        else:
            effects.append(e)
    return SplitStudy(
        split=name,
        runs=len(curves),
        frontier=fr,
        effects=tuple(effects),
        n_star=n_star_change(fr, n_boot=n_boot, level=level, seed=seed),
        interference=interference(rows, n_key, x=x, n_boot=n_boot, level=level, seed=seed + 99),
        notes=tuple(notes),
    )


def analyse_isocompute(
    rows: Sequence[Mapping[str, Any]],
    *,
    split_by: str = "",
    x: str = "rollouts",
    metric: str = "val/pass@1",
    n_key: str = "sampling.n",
    bp_key: str = "data.prompts_per_batch",
    group_by: str = "group",
    n_boot: int = 200,
    level: float = 0.95,
) -> IsoStudy:
    """The study of an iso-compute grid's curve rows, one frontier per `split_by` value
    (the rows' first split is the 'easy' one of the findings unless a split is so named)."""
    splits: dict[str, list] = {}
    for r in rows:
        splits.setdefault(str(r.get(split_by, "all")) if split_by else "all", []).append(r)
    out = {}
    for k, (name, subset) in enumerate(splits.items()):
        try:
            out[name] = analyse_split(
                name,
                subset,
                x=x,
                metric=metric,
                n_key=n_key,
                bp_key=bp_key,
                group_by=group_by,
                n_boot=n_boot,
                level=level,
                seed=1000 * k,
            )
        except (FrontierError, CurveError) as e:
            raise FitError(f"split {name!r}: {e}") from None
    return IsoStudy(x=x, metric=metric, level=level, n_boot=n_boot, splits=out)
