"""Bootstrap intervals for A, B, C_mid (and R0), over evaluation points or over seeds.

Every replicate refits by warm-started bounded least squares from the point
estimate (the same objective as the `grid` method), all replicates at once
(`batch_lsq`), so 200 replicates cost a fraction of a second.

Kinds (pick by name):
- `residual`: y* = R(x) + resampled residuals, inflated by sqrt(n / (n - p)) for
  the degrees of freedom the fit used. With R0 from the first evaluation, R0*
  gets a resampled residual too (it is one noisy evaluation, or the mean of k).
- `parametric`: as `residual` with Gaussian noise of the residual variance.
- `points`: resample (x, y) pairs; R0 from the first evaluation is kept as is.
- over seeds (`bootstrap_runs`): resample whole runs of a recipe, refit the pool.
Intervals are percentile intervals; tests measure their coverage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rl_jax.scaling._sigmoid import FitError, SigmoidFit, batch_lsq, fit_sigmoid_runs, sigmoid

_MAX_FAILED_FRACTION = 0.1


@dataclass(frozen=True, kw_only=True, eq=False)
class Bootstrap:
    """Bootstrap samples of a fit's parameters and the intervals they give."""

    fit: SigmoidFit
    kind: str
    level: float
    samples: dict[str, np.ndarray]  # name -> [n_ok] for R0, A, B, C_mid
    n_boot: int
    n_failed: int
    warnings: tuple[str, ...] = ()

    def interval(self, name: str, level: float | None = None) -> tuple[float, float]:
        if name not in self.samples:
            raise KeyError(f"no parameter {name!r}; known: {sorted(self.samples)}")
        q = _quantiles(self.level if level is None else level)
        lo, hi = np.quantile(self.samples[name], q)
        return float(lo), float(hi)

    def intervals(self) -> dict[str, tuple[float, float]]:
        return {k: self.interval(k) for k in self.samples}

    def curves(self, c) -> np.ndarray:
        """[n_ok, len(c)] the fitted curve of every replicate."""
        s = self.samples
        return np.stack(
            [
                sigmoid(c, r0=r0, a=a, b=b, c_mid=cm)
                for r0, a, b, cm in zip(s["R0"], s["A"], s["B"], s["C_mid"], strict=True)
            ]
        )

    def band(self, c, *, level: float | None = None, predictive: bool = False):
        """(lo, hi) of the curve at compute c; predictive=True adds evaluation noise, i.e. the
        interval a new evaluation at c should fall in.

        The noise is Student-t with the fit's residual scale and degrees of freedom: the
        empirical residuals of a short curve (20 points, say) have too light tails for the
        outer 5%, and a t accounts for the scale itself being estimated."""
        c = np.atleast_1d(np.asarray(c, dtype=float))
        curves = self.curves(c)
        if predictive:
            rng = np.random.default_rng(0)  # deterministic bands
            t = rng.standard_t(self.fit.dof, size=(max(4, 2000 // len(curves)),) + curves.shape)
            curves = (curves[None] + self.fit.sigma * t).reshape(-1, c.size)
        q = _quantiles(self.level if level is None else level)
        lo, hi = np.quantile(curves, q, axis=0)
        return lo, hi


def _quantiles(level: float) -> list[float]:
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1), e.g. 0.95")
    return [(1 - level) / 2, (1 + level) / 2]


def _start(fit: SigmoidFit) -> np.ndarray:
    return np.array([fit.A, math.log(fit.C_mid), fit.B, fit.R0])


def _scaled_residuals(fit: SigmoidFit) -> np.ndarray:
    if fit.dof <= 0:
        raise FitError(
            f"cannot bootstrap a fit with {fit.n_points} points and {fit.n_params} parameters: "
            "no residual degrees of freedom"
        )
    r = fit.residuals - fit.residuals.mean()
    return r * math.sqrt(fit.n_points / fit.dof)


def _draw_residual(fit: SigmoidFit, rng, pool, n_boot):
    e = rng.choice(pool, size=(n_boot, fit.n_points))
    r0 = None
    if fit.r0_source == "first":
        r0 = fit.R0 + rng.choice(pool, size=(n_boot, max(fit.r0_count, 1))).mean(1)
    return e, r0


def _draw_parametric(fit: SigmoidFit, rng, pool, n_boot):
    sd = float(np.sqrt((pool**2).mean()))
    e = rng.normal(0.0, sd, size=(n_boot, fit.n_points))
    r0 = None
    if fit.r0_source == "first":
        r0 = fit.R0 + rng.normal(0.0, sd / math.sqrt(max(fit.r0_count, 1)), size=n_boot)
    return e, r0


_DRAWS: dict[str, Callable] = {"residual": _draw_residual, "parametric": _draw_parametric}
BOOTSTRAP_KINDS = ("residual", "parametric", "points")


def bootstrap(
    fit: SigmoidFit,
    *,
    kind: str = "residual",
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
) -> Bootstrap:
    """Bootstrap a fitted curve over its evaluation points; see the module doc for kinds."""
    if kind not in BOOTSTRAP_KINDS:
        raise ValueError(f"unknown bootstrap kind {kind!r}; known: {list(BOOTSTRAP_KINDS)}")
    _check_args(n_boot, level)
    rng = np.random.default_rng(seed)
    pool = _scaled_residuals(fit)
    start = _start(fit)
    if kind == "points":
        idx = np.sort(rng.integers(0, fit.n_points, (n_boot, fit.n_points)), axis=1)
        xb, yb = fit.x[idx], fit.y[idx]
        # A resample with fewer distinct points than parameters cannot be fitted.
        ok = np.array([np.unique(r).size >= fit.n_params for r in idx])
        ok &= np.array([np.unique(r[r > 0]).size >= 2 for r in xb])
        p, _ = batch_lsq(fit.problem, yb[ok], start, x=xb[ok])
        return _result(fit, kind, level, p, n_boot, int((~ok).sum()))
    e, r0 = _DRAWS[kind](fit, rng, pool, n_boot)
    p, _ = batch_lsq(fit.problem, fit.predict(fit.x)[None, :] + e, start, r0=r0)
    return _result(fit, kind, level, p, n_boot, 0)


def _check_args(n_boot: int, level: float) -> None:
    _quantiles(level)
    if n_boot < 20:
        raise ValueError(f"n_boot={n_boot} is too few for {level:.0%} intervals; use >= 20")


def _result(fit, kind, level, p, n_boot, failed, warnings=()) -> Bootstrap:
    warn = list(warnings)
    ok = np.isfinite(p).all(1)
    failed += int((~ok).sum())
    p = p[ok]
    if len(p) < max(10, n_boot // 2):
        raise FitError(
            f"{failed} of {n_boot} bootstrap refits failed; the curve is too degenerate for "
            "intervals"
        )
    if failed > _MAX_FAILED_FRACTION * n_boot:
        warn.append(f"{failed} of {n_boot} bootstrap refits failed; intervals may be too narrow")
    # p: [n_ok, 4] in (A, log C_mid, B, R0)
    samples = {"R0": p[:, 3], "A": p[:, 0], "B": p[:, 2], "C_mid": np.exp(p[:, 1])}
    return Bootstrap(
        fit=fit,
        kind=kind,
        level=level,
        samples=samples,
        n_boot=n_boot,
        n_failed=failed,
        warnings=tuple(warn),
    )


def bootstrap_runs(
    runs: Sequence[tuple[Sequence[float], Sequence[float]]],
    fit: SigmoidFit | None = None,
    *,
    n_boot: int = 200,
    level: float = 0.95,
    seed: int = 0,
    **fit_kwargs,
) -> Bootstrap:
    """Bootstrap over seeds: resample whole runs of one recipe and refit their pool.

    `fit` is the pooled fit of all runs (fit_sigmoid_runs with the same options); it is
    computed when not given. With k runs there are only C(2k-1, k) distinct resamples, so
    for a handful of seeds the interval is coarse: a warning says so.
    """
    if len(runs) < 2:
        raise FitError(f"bootstrap over seeds needs >= 2 runs of the recipe, got {len(runs)}")
    _check_args(n_boot, level)
    if fit is None:
        fit = fit_sigmoid_runs(runs, **fit_kwargs)
    opts = fit.options
    rng = np.random.default_rng(seed)
    _scaled_residuals(fit)  # raises when the pooled fit has no residual degrees of freedom
    first = opts.r0 == "first"
    parts = []
    for x, y in runs:
        x, y = np.asarray(x, float), np.asarray(y, float)
        if opts.fit_start is not None:
            keep = x >= opts.fit_start
            keep[0] |= first  # R0's evaluation is used whatever the window
            x, y = x[keep], y[keep]
        parts.append((x[1:], y[1:], y[0]) if first else (x, y, np.nan))
    # A replicate can draw the longest run every time (runs of a grid still running, or
    # cut short, differ in length).
    longest = len(runs) * max(p[0].size for p in parts)
    picks = rng.integers(0, len(runs), (n_boot, len(runs)))
    # Replicates pool different runs, hence different lengths: pad with weight-0 points.
    xb = np.full((n_boot, longest), fit.x[-1])
    yb = np.zeros((n_boot, longest))
    wb = np.zeros((n_boot, longest))
    r0 = np.empty(n_boot)
    for r, pick in enumerate(picks):
        x = np.concatenate([parts[i][0] for i in pick])
        y = np.concatenate([parts[i][1] for i in pick])
        order = np.argsort(x, kind="stable")
        xb[r, : x.size], yb[r, : x.size], wb[r, : x.size] = x[order], y[order], 1.0
        r0[r] = np.mean([parts[i][2] for i in pick])
    p, _ = batch_lsq(fit.problem, yb, _start(fit), x=xb, w=wb, r0=r0 if first else None)
    warn = []
    if len(runs) < 5:
        warn.append(
            f"only {len(runs)} runs: a bootstrap over seeds has few distinct resamples and its "
            "intervals are coarse"
        )
    return _result(fit, "runs", level, p, n_boot, 0, warn)
