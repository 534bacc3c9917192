"""Extrapolation checks: fit on compute up to a fraction of the run, predict the rest.

ScaleRL validated its fits this way (half the budget, or 50k of 100k GPU-hours).
The check reports the errors of the held-out points, the fitted curve's
bootstrap band there, and whether the held-out evaluations fall inside the
predictive interval (band plus evaluation noise). The power law is extrapolated
from the same window for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rl_jax.scaling._bootstrap import Bootstrap, bootstrap
from rl_jax.scaling._power import PowerLawFit, fit_power_law
from rl_jax.scaling._sigmoid import FitError, SigmoidFit, check_xy, fit_sigmoid


@dataclass(frozen=True, kw_only=True, eq=False)
class Extrapolation:
    fraction: float
    cutoff: float  # compute up to which points were fitted
    fit: SigmoidFit  # on the points up to cutoff
    boot: Bootstrap = field(repr=False)
    x_test: np.ndarray  # [M] held-out compute
    y_test: np.ndarray  # [M] held-out evaluations
    y_pred: np.ndarray  # [M] the fit's prediction
    band: tuple[np.ndarray, np.ndarray]  # the curve's interval at x_test
    predictive: tuple[np.ndarray, np.ndarray]  # where a new evaluation should fall
    power_law: PowerLawFit | None
    power_law_pred: np.ndarray | None

    @property
    def errors(self) -> np.ndarray:
        return self.y_pred - self.y_test

    @property
    def rmse(self) -> float:
        return float(np.sqrt(np.mean(self.errors**2)))

    @property
    def max_abs_error(self) -> float:
        return float(np.abs(self.errors).max())

    @property
    def final_error(self) -> float:
        """Prediction minus evaluation at the last point of the run."""
        return float(self.errors[-1])

    @property
    def coverage(self) -> float:
        """Fraction of held-out evaluations inside the predictive interval."""
        lo, hi = self.predictive
        return float(np.mean((self.y_test >= lo) & (self.y_test <= hi)))

    @property
    def final_within(self) -> bool:
        lo, hi = self.predictive
        return bool(lo[-1] <= self.y_test[-1] <= hi[-1])

    @property
    def power_law_rmse(self) -> float | None:
        if self.power_law_pred is None:
            return None
        return float(np.sqrt(np.mean((self.power_law_pred - self.y_test) ** 2)))

    def summary(self) -> dict:
        lo, hi = self.predictive
        return {
            "fraction": self.fraction,
            "cutoff": self.cutoff,
            "n_fit": self.fit.n_points,
            "n_test": int(self.x_test.size),
            "A_partial": self.fit.A,
            "A_partial_interval": list(self.boot.interval("A")),
            "rmse": self.rmse,
            "max_abs_error": self.max_abs_error,
            "final_error": self.final_error,
            "final_interval": [float(lo[-1]), float(hi[-1])],
            "final_within": self.final_within,
            "coverage": self.coverage,
            "level": self.boot.level,
            "reliable": self.fit.reliable,
            "power_law_A": None if self.power_law is None else self.power_law.A,
            "power_law_rmse": self.power_law_rmse,
        }


def extrapolation_check(
    x,
    y,
    *,
    fraction: float = 0.5,
    n_boot: int = 200,
    level: float = 0.95,
    kind: str = "residual",
    seed: int = 0,
    **fit_kwargs,
) -> Extrapolation:
    """Fit on points with compute <= fraction * (last compute), predict the others.

    fit_kwargs go to fit_sigmoid (r0, method, fit_start, metric_range, ...). R0 taken from
    the first evaluation is the same in both halves.
    """
    if not 0 < fraction < 1:
        raise FitError(f"fraction={fraction!r} must be in (0, 1), e.g. 0.5 for half the compute")
    x, y = check_xy(x, y)
    if x.size == 0:
        raise FitError("empty curve")
    cutoff = fraction * float(x[-1])
    train = x <= cutoff
    if train.all() or not train.any():
        raise FitError(f"no points on one side of the cutoff {cutoff:g}")
    fit = fit_sigmoid(x[train], y[train], **fit_kwargs)
    boot = bootstrap(fit, kind=kind, n_boot=n_boot, level=level, seed=seed)
    xt, yt = x[~train], y[~train]
    metric_range = fit.options.metric_range
    try:
        pl = fit_power_law(
            x[train], y[train], metric_range=metric_range, fit_start=fit.options.fit_start
        )
        pl_pred = pl.predict(xt)
    except FitError:
        pl, pl_pred = None, None
    return Extrapolation(
        fraction=fraction,
        cutoff=cutoff,
        fit=fit,
        boot=boot,
        x_test=xt,
        y_test=yt,
        y_pred=fit.predict(xt),
        band=boot.band(xt),
        predictive=boot.band(xt, predictive=True),
        power_law=pl,
        power_law_pred=pl_pred,
    )
