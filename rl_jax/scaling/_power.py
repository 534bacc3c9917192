"""The power law R = A - D / C^B, fitted for comparison with the sigmoid.

ScaleRL (PAPERS.md section 1) shows that a power law fitted on early windows
overshoots the asymptote (A = 1.0 or 0.74 for a run saturating near 0.65); the
report puts both side by side. Compute is rescaled by its geometric mean so D
stays representable for FLOP-denominated x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rl_jax.scaling._sigmoid import FitError, check_xy, lowest_cost

_B_BOUNDS = (1e-3, 10.0)
_LOGD_BOUNDS = (-40.0, 10.0)


@dataclass(frozen=True, kw_only=True, eq=False)
class PowerLawFit:
    A: float
    B: float
    D: float  # R = A - D / C^B, in the units of x
    c_ref: float  # x is divided by c_ref inside the fit
    log_d_ref: float  # log D' with R = A - D' (C / c_ref)^-B (D itself may be huge)
    x: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    residuals: np.ndarray = field(repr=False)
    sse: float
    r2: float
    rmse: float
    reliable: bool
    warnings: tuple[str, ...]

    def predict(self, c) -> np.ndarray:
        c = np.asarray(c, dtype=float)
        with np.errstate(divide="ignore"):
            u = np.log(c / self.c_ref)
        return self.A - np.exp(self.log_d_ref - self.B * u)

    def params(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "D": self.D}


def fit_power_law(
    x, y, *, metric_range: tuple[float, float] = (0.0, 1.0), fit_start: float | None = None
) -> PowerLawFit:
    """Bounded least squares for R = A - D / C^B over points with compute > 0 (and >= fit_start).

    A is capped at the metric's maximum; a fit that needs a higher ceiling is flagged.
    """
    x, y = check_xy(x, y)
    keep = x > 0
    if fit_start is not None:
        keep &= x >= fit_start
    x, y = x[keep], y[keep]
    if x.size < 3 or np.unique(x).size < 2:
        raise FitError(f"the power law has 3 parameters; got {x.size} point(s) with compute > 0")
    lo_m, hi_m = metric_range
    c_ref = float(np.exp(np.log(x).mean()))
    u = np.log(x / c_ref)
    span = float(np.ptp(y)) or 0.05

    def fun(p):
        a, logd, b = p
        return a - np.exp(logd - b * u) - y

    def jac(p):
        a, logd, b = p
        t = np.exp(logd - b * u)
        return np.stack([np.ones_like(u), -t, t * u], axis=1)

    lo = np.array([float(y.min()), _LOGD_BOUNDS[0], _B_BOUNDS[0]])
    hi = np.array([hi_m, _LOGD_BOUNDS[1], _B_BOUNDS[1]])
    if hi[0] <= lo[0]:
        raise FitError(f"metric already at its maximum {hi_m:g}: nothing left to fit")
    best = _best_of_starts(fun, jac, lo, hi, y, span)
    a, logd, b = (float(t) for t in best.x)
    res = -fun(best.x)
    sse = float((res**2).sum())
    sst = float(((y - y.mean()) ** 2).sum())
    why = _warnings(a, b, logd, lo, hi, hi_m, points=x.size)
    return PowerLawFit(
        A=a,
        B=b,
        D=math.exp(min(logd + b * math.log(c_ref), 700.0)),
        c_ref=c_ref,
        log_d_ref=logd,
        x=x,
        y=y,
        residuals=res,
        sse=sse,
        r2=1 - sse / sst if sst > 0 else float("nan"),
        rmse=math.sqrt(sse / x.size),
        reliable=not why,
        warnings=tuple(why),
    )


def _best_of_starts(fun, jac, lo, hi, y, span):
    """The least-squares result of lowest cost over a small grid of starts (A above the
    data, B from slow to fast)."""
    starts = []
    for a0 in (y.max() + 0.2 * span, y.max() + span):
        for b0 in (0.1, 0.5, 1.5):
            a0c = float(np.clip(a0, lo[0] + 1e-9, hi[0] - 1e-9))
            gap = max(a0c - float(np.median(y)), 1e-6)
            starts.append(np.clip([a0c, math.log(gap), b0], lo + 1e-9, hi - 1e-9))
    best = lowest_cost(fun, starts, jac=jac, bounds=(lo, hi), x_scale="jac")
    if best is None:
        raise FitError("power-law least squares failed from every start")
    return best


def _warnings(a, b, logd, lo, hi, hi_m, *, points: int) -> list[str]:
    """Why the fit is not reliable: a parameter at a bound, or no spare points."""
    why = []
    if a >= hi[0] - 1e-3 * (hi[0] - lo[0]):
        why.append(
            f"A = {a:.4g} is at the metric's maximum {hi_m:g}: the power law does not saturate "
            "within the data"
        )
    for name, v, (blo, bhi) in (("B", b, _B_BOUNDS), ("log D", logd, _LOGD_BOUNDS)):
        if v <= blo + 1e-6 * (bhi - blo) or v >= bhi - 1e-6 * (bhi - blo):
            why.append(f"{name} = {v:.4g} is at a bound of [{blo:g}, {bhi:g}]")
    if points == 3:
        why.append("3 points for 3 parameters: the fit interpolates")
    return why
