"""The calls the grid makes into rl_jax.scaling, in one place.

The grid needs four things from the scaling library: a sigmoid fit of one
curve or of a recipe's pooled seeds, bootstrap samples of its parameters, a
refit at a held asymptote (the paper's rule when two A's are within 0.02), and
predictions. Everything grid-specific (which runs form a curve, the frontier
over runs, n*(C), early-stop decisions) is built from these in
`rl_jax.grid.results`. When the library is missing, `missing()` says why and
the report keeps its tables and plots of raw curves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

try:  # the public API
    from rl_jax.scaling import (  # type: ignore[attr-defined]
        FitError,
        bootstrap,
        bootstrap_runs,
        fit_sigmoid,
        fit_sigmoid_runs,
        refit,
    )

    _MISSING = ""
except ImportError:
    try:  # the same functions before rl_jax.scaling re-exports them
        from rl_jax.scaling._bootstrap import bootstrap, bootstrap_runs
        from rl_jax.scaling._sigmoid import FitError, fit_sigmoid, fit_sigmoid_runs, refit

        _MISSING = ""
    except ImportError as e:
        _MISSING = f"rl_jax.scaling is not available in this build ({e})"

        class FitError(ValueError):  # type: ignore[no-redef]
            """Stands in for rl_jax.scaling.FitError so callers can always catch it."""


Curve = tuple[Sequence[float], Sequence[float]]


def missing() -> str:
    """'' when the scaling library can be used, else why not."""
    return _MISSING


def fit(runs: Sequence[Curve], **options):
    """One sigmoid through one curve or the pooled curves of a recipe's seeds."""
    if len(runs) == 1:
        return fit_sigmoid(*runs[0], **options)
    return fit_sigmoid_runs(list(runs), **options)


def param_samples(f, runs: Sequence[Curve], *, n_boot: int = 200, seed: int = 0):
    """Bootstrap samples {name: [n]} of (R0, A, B, C_mid): over seeds if several, else points."""
    if len(runs) >= 2:
        bs = bootstrap_runs(list(runs), f, n_boot=n_boot, seed=seed)
    else:
        bs = bootstrap(f, n_boot=n_boot, seed=seed)
    return bs.samples, bs.intervals()


def refit_at(f, a: float):
    """The same points refitted with the asymptote held at `a` (compare B at a common A)."""
    return refit(f, a_fixed=a)


def predict(f, c) -> np.ndarray:
    return np.asarray(f.predict(np.asarray(c, dtype=float)), dtype=float)


def params(f) -> dict[str, float]:
    return {k: float(v) for k, v in f.params().items()}


def p_reaches(samples: np.ndarray, leader: np.ndarray) -> float:
    """P(A_run >= A_leader) from independent bootstrap samples of the two asymptotes."""
    a = np.sort(np.asarray(samples, float))
    b = np.asarray(leader, float)
    if a.size == 0 or b.size == 0:
        return math.nan
    # For each leader draw, the fraction of run draws at or above it.
    return float(np.mean(1.0 - np.searchsorted(a, b, side="left") / a.size))
