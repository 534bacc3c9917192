"""The ScaleRL sigmoid R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B), fitted two ways.

`grid` is the paper's procedure (PAPERS.md section 1): a grid over A and C_mid,
B fitted per cell, least squared residuals kept. `lsq` is a bounded nonlinear
least squares from several starts. Both minimize the same unweighted sum of
squares, so they agree whenever the grid is fine enough; `grid` is the one to
quote when reproducing the paper, `lsq` the fast one (bootstrap refits use it).

The model is evaluated in log compute, (C_mid / C)^B = exp(-B (log C - log C_mid)),
which is stable for compute in FLOPs (1e12..1e20) as well as in GPU-hours, and
gives R(0) = R0 exactly for an evaluation at step 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize, special, stats

# The paper's grids (C_mid in GPU-hours): A in {0.450, 0.455, ..., 0.800}, and
# 100 linearly spaced C_mid in [100, 40000].
PAPER_A_GRID = tuple(np.round(np.arange(0.450, 0.8000001, 0.005), 6).tolist())
PAPER_C_MID_GRID = tuple(np.linspace(100.0, 40000.0, 100).tolist())

# Data-relative C_mid range: one decade either side of the observed compute, so
# that a midpoint before the first or after the last evaluation can be found
# (and flagged) rather than silently clipped.
_C_MID_DECADES_OUT = 1.0
# Flat-curve test: a sigmoid that does not beat a constant at this level is
# reported as unreliable (there is no gain to fit).
_FLAT_P_VALUE = 0.01


class FitError(ValueError):
    """The input cannot be fitted; the message says what was wrong and what to do."""


def sigmoid(c, *, r0: float, a: float, b: float, c_mid: float) -> np.ndarray:
    """R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B); R(0) = R0."""
    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore"):
        u = np.log(c)
    return r0 + (a - r0) * special.expit(b * (u - math.log(c_mid)))


@dataclass(frozen=True, kw_only=True)
class SigmoidOptions:
    """How to fit one curve. Defaults suit FLOP- or rollout-denominated curves of pass rates."""

    r0: str | float = "first"  # 'first' (the first evaluation), 'fit', or a number
    method: str = "grid"  # see SIGMOID_METHODS
    fit_start: float | None = None  # points at compute < fit_start are not fitted
    a_grid: str | tuple[float, ...] = "data"  # 'data', 'paper', or explicit values
    c_mid_grid: str | tuple[float, ...] = "data"  # 'data', 'paper', or explicit values
    n_a: int = 71  # size of the data-relative A grid (the paper: 71)
    n_c_mid: int = 80  # size of the data-relative C_mid grid (log-spaced)
    refine: bool = True  # zoom the grid once around its best cell
    b_solver: str = "vectorized"  # per-cell B fit in `grid`: 'vectorized' or 'curve_fit'
    metric_range: tuple[float, float] = (0.0, 1.0)  # bounds of the metric (pass rates)
    b_bounds: tuple[float, float] = (0.05, 20.0)
    n_starts: int = 12  # starts of `lsq`
    a_fixed: float | None = None  # hold A (the paper's rule refits at a common A)

    def __post_init__(self):
        if isinstance(self.r0, str) and self.r0 not in ("first", "fit"):
            raise FitError(f"r0={self.r0!r}: use 'first', 'fit' or a number")
        if not isinstance(self.r0, str) and not math.isfinite(float(self.r0)):
            raise FitError(f"r0={self.r0!r} must be finite")
        if self.method not in SIGMOID_METHODS:
            raise FitError(f"unknown fit method {self.method!r}; known: {sorted(SIGMOID_METHODS)}")
        for name in ("a_grid", "c_mid_grid"):
            v = getattr(self, name)
            if isinstance(v, str) and v not in ("data", "paper"):
                raise FitError(f"{name}={v!r}: use 'data', 'paper' or a sequence of values")
            if not isinstance(v, str):
                object.__setattr__(self, name, tuple(float(t) for t in v))
                if not getattr(self, name):
                    raise FitError(f"{name} is empty")
                if not all(math.isfinite(t) for t in getattr(self, name)):
                    raise FitError(f"{name}={v!r}: grid values must be finite numbers")
        if self.b_solver not in ("vectorized", "curve_fit"):
            raise FitError(f"b_solver={self.b_solver!r}: use 'vectorized' or 'curve_fit'")
        lo, hi = (float(t) for t in self.metric_range)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise FitError(
                f"metric_range={self.metric_range!r} must be finite (low, high), low < high"
            )
        object.__setattr__(self, "metric_range", (lo, hi))
        blo, bhi = (float(t) for t in self.b_bounds)
        if not (0 < blo < bhi and math.isfinite(bhi)):
            raise FitError(f"b_bounds={self.b_bounds!r} must be finite, 0 < low < high")
        object.__setattr__(self, "b_bounds", (blo, bhi))
        for name in ("n_a", "n_c_mid", "n_starts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise FitError(f"{name}={v!r} must be an integer")
        if self.n_a < 3 or self.n_c_mid < 3 or self.n_starts < 1:
            raise FitError("n_a and n_c_mid must be >= 3 and n_starts >= 1")


@dataclass(frozen=True, eq=False)
class _Problem:
    """The points to fit and the box the parameters live in."""

    x: np.ndarray  # [N] compute, >= 0, non-decreasing
    y: np.ndarray  # [N]
    r0: float | None  # fixed R0, or None when fitted
    a_fixed: float | None
    a_lo: float
    a_hi: float
    r0_lo: float
    r0_hi: float
    logc_lo: float
    logc_hi: float
    b_lo: float
    b_hi: float

    @property
    def u(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return np.log(self.x)

    @property
    def n_params(self) -> int:
        return 2 + (self.a_fixed is None) + (self.r0 is None)

    def with_y(self, y: np.ndarray, r0: float | None = None) -> _Problem:
        return dataclasses.replace(self, y=y, r0=self.r0 if r0 is None else r0)


@dataclass(frozen=True, kw_only=True, eq=False)
class SigmoidFit:
    """A fitted sigmoid. `reliable` is False whenever a warning says the numbers should not be
    trusted (too few points, a flat curve, a parameter stuck on its bound, ...)."""

    R0: float
    A: float
    B: float
    C_mid: float
    x: np.ndarray  # [N] fitted points (after the fit window; R0's point excluded for 'first')
    y: np.ndarray  # [N]
    residuals: np.ndarray  # [N] y - R(x)
    sse: float
    r2: float
    rmse: float
    n_params: int
    r0_source: str  # 'first', 'fit' or 'given'
    r0_count: int  # evaluations averaged into R0 ('first' over k runs); 0 if not observed
    method: str
    reliable: bool
    warnings: tuple[str, ...]
    options: SigmoidOptions
    problem: _Problem = field(repr=False)

    @property
    def n_points(self) -> int:
        return int(self.x.size)

    @property
    def dof(self) -> int:
        return self.n_points - self.n_params

    @property
    def sigma(self) -> float:
        """Residual standard deviation (nan without residual degrees of freedom)."""
        return math.sqrt(self.sse / self.dof) if self.dof > 0 else float("nan")

    def predict(self, c) -> np.ndarray:
        return sigmoid(c, r0=self.R0, a=self.A, b=self.B, c_mid=self.C_mid)

    def params(self) -> dict[str, float]:
        return {"R0": self.R0, "A": self.A, "B": self.B, "C_mid": self.C_mid}


# --------------------------------------------------------------------------- inputs


def _as_1d(name: str, v) -> np.ndarray:
    a = np.asarray(v, dtype=float)
    if a.ndim != 1:
        raise FitError(f"{name} must be one-dimensional, got shape {a.shape}")
    return a


def check_xy(x, y) -> tuple[np.ndarray, np.ndarray]:
    """Validate a curve: finite, compute >= 0 and sorted. Errors say which points are bad."""
    x, y = _as_1d("x", x), _as_1d("y", y)
    if x.size != y.size:
        raise FitError(f"x and y differ in length: {x.size} vs {y.size}")
    bad = np.flatnonzero(~(np.isfinite(x) & np.isfinite(y)))
    if bad.size:
        raise FitError(
            f"{bad.size} point(s) have NaN/inf compute or metric (indices {bad[:10].tolist()}); "
            "drop them first (curves_from_rows drops and flags them)"
        )
    if (x < 0).any():
        i = int(np.flatnonzero(x < 0)[0])
        raise FitError(f"compute must be >= 0; x[{i}] = {x[i]:g}")
    dec = np.flatnonzero(np.diff(x) < 0)
    if dec.size:
        i = int(dec[0])
        raise FitError(
            f"compute is not increasing: x[{i + 1}] = {x[i + 1]:g} < x[{i}] = {x[i]:g}; "
            "x must be cumulative compute sorted by step"
        )
    return x, y


def _grid_values(spec, paper: tuple[float, ...], data: np.ndarray) -> np.ndarray:
    if spec == "data":
        return data
    if spec == "paper":
        return np.asarray(paper, dtype=float)
    return np.asarray(sorted(spec), dtype=float)


def _c_mid_range(grid, pos: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    """C_mid's box: the paper's grid (which must overlap the compute), decades around the
    data's compute ("data"), or an explicit grid's span."""
    if grid == "paper":
        c_lo, c_hi = PAPER_C_MID_GRID[0], PAPER_C_MID_GRID[-1]
        if c_hi < pos.min() or c_lo > x.max():
            raise FitError(
                f"the paper's C_mid grid [{c_lo:g}, {c_hi:g}] (GPU-hours) does not overlap the "
                f"compute range [{pos.min():g}, {x.max():g}]; use the data-relative grid"
            )
    elif grid == "data":
        c_lo = pos.min() / 10**_C_MID_DECADES_OUT
        c_hi = x.max() * 10**_C_MID_DECADES_OUT
    else:
        c_lo, c_hi = min(grid), max(grid)
        if c_lo <= 0:
            raise FitError(f"C_mid grid values must be > 0, got {c_lo:g}")
    return c_lo, c_hi


def _build_problem(
    x: np.ndarray, y: np.ndarray, opts: SigmoidOptions, *, r0: float | None
) -> tuple[_Problem, list[str]]:
    """Window the points and derive the parameter box from the data (or the paper's grids)."""
    notes: list[str] = []
    lo, hi = opts.metric_range
    if opts.fit_start is not None:
        keep = x >= opts.fit_start
        if not keep.all():
            notes.append(f"{int((~keep).sum())} point(s) before fit_start={opts.fit_start:g}")
        x, y = x[keep], y[keep]
    n_params = 2 + (opts.a_fixed is None) + (r0 is None)
    if x.size < n_params:
        raise FitError(
            f"{x.size} point(s) to fit but the sigmoid has {n_params} free parameters; "
            "need more evaluations (or a smaller fit_start)"
        )
    pos = x[x > 0]
    if np.unique(pos).size < 2:
        raise FitError(
            f"need at least 2 distinct positive compute values to fit B and C_mid, got "
            f"{np.unique(pos).size}"
        )
    if (y > hi).any() or (y < lo).any():
        raise FitError(
            f"metric values span [{y.min():g}, {y.max():g}], outside metric_range=({lo:g}, "
            f"{hi:g}); pass a metric_range that holds the metric (pass rates live in [0, 1])"
        )
    if r0 is not None and not lo <= r0 <= hi:
        raise FitError(
            f"R0 = {r0:g} is outside metric_range=({lo:g}, {hi:g}); give an r0 in that range "
            "(or 'first' or 'fit')"
        )
    if r0 is not None:
        a_lo, r0_lo, r0_hi = r0, r0, r0
    else:
        a_lo, r0_lo, r0_hi = float(y.min()), lo, float(y.max())
    a_hi = hi
    if a_hi <= a_lo:
        raise FitError(f"R0 = {a_lo:g} is already at the metric's maximum {a_hi:g}: no gain to fit")
    if opts.a_fixed is not None:
        if not a_lo <= opts.a_fixed <= a_hi:
            raise FitError(f"a_fixed={opts.a_fixed:g} is outside [{a_lo:g}, {a_hi:g}]")
        a_lo = a_hi = float(opts.a_fixed)
    c_lo, c_hi = _c_mid_range(opts.c_mid_grid, pos, x)
    prob = _Problem(
        x=x,
        y=y,
        r0=r0,
        a_fixed=opts.a_fixed,
        a_lo=float(a_lo),
        a_hi=float(a_hi),
        r0_lo=float(r0_lo),
        r0_hi=float(r0_hi),
        logc_lo=math.log(c_lo),
        logc_hi=math.log(c_hi),
        b_lo=opts.b_bounds[0],
        b_hi=opts.b_bounds[1],
    )
    return prob, notes


# --------------------------------------------------------------------------- grid method

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _cell_sse(
    logb: np.ndarray, a: np.ndarray, dist: np.ndarray, prob: _Problem, *, want_r0: bool = False
):
    """SSE of K cells (A, log C_mid, log B) given dist = log C - log C_mid [K, N].

    R0 is fixed, or in closed form when free (the model is linear in R0 given the rest:
    f = R0 (1 - s) + A s). Written with in-place ops: this is the grid's inner loop.
    """
    y = prob.y
    s = np.multiply(dist, np.exp(logb)[:, None])
    special.expit(s, out=s)  # [K, N]
    if prob.r0 is not None:
        r0 = np.full(a.shape, prob.r0)
    else:
        w = 1.0 - s
        num = np.einsum("kn,kn->k", w, y[None, :] - a[:, None] * s)
        den = np.einsum("kn,kn->k", w, w)
        r0 = np.where(den > 1e-12, num / np.maximum(den, 1e-300), prob.r0_lo)
        r0 = np.clip(r0, prob.r0_lo, np.minimum(a, prob.r0_hi))
    s *= (a - r0)[:, None]
    s += r0[:, None]
    s -= y[None, :]
    sse = np.einsum("kn,kn->k", s, s)
    return (sse, r0) if want_r0 else sse


def _solve_b_vectorized(a, m, prob, *, n_coarse=16, n_golden=18):
    """Per cell, the least-squares B: a coarse log-B scan then golden-section refinement."""
    with np.errstate(invalid="ignore"):
        dist = prob.u[None, :] - m[:, None]  # [K, N]; -inf at compute 0 gives s = 0
    lb_lo, lb_hi = math.log(prob.b_lo), math.log(prob.b_hi)
    grid = np.linspace(lb_lo, lb_hi, n_coarse)
    sse = np.stack([_cell_sse(np.full(a.shape, g), a, dist, prob) for g in grid])  # [n_coarse, K]
    j = sse.argmin(0)
    best_lb, best_sse = grid[j], sse[j, np.arange(a.size)]
    lo = grid[np.maximum(j - 1, 0)]
    hi = grid[np.minimum(j + 1, n_coarse - 1)]
    c = hi - _GOLDEN * (hi - lo)
    d = lo + _GOLDEN * (hi - lo)
    fc = _cell_sse(c, a, dist, prob)
    fd = _cell_sse(d, a, dist, prob)
    for _ in range(n_golden):
        left = fc < fd  # the minimum lies in [lo, d]
        lo = np.where(left, lo, c)
        hi = np.where(left, d, hi)
        new = np.where(left, hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo))
        fnew = _cell_sse(new, a, dist, prob)
        c, d, fc, fd = (
            np.where(left, new, d),
            np.where(left, c, new),
            np.where(left, fnew, fd),
            np.where(left, fc, fnew),
        )
    for cand, fcand in ((c, fc), (d, fd)):
        better = fcand < best_sse
        best_lb = np.where(better, cand, best_lb)
        best_sse = np.where(better, fcand, best_sse)
    sse, r0 = _cell_sse(best_lb, a, dist, prob, want_r0=True)
    return np.exp(best_lb), r0, sse


def _solve_b_curve_fit(a, m, prob):
    """The paper's per-cell step verbatim: scipy's curve_fit for B (and R0 when free)."""
    u, y = prob.u, prob.y
    bs, r0s, sses = np.empty(a.size), np.empty(a.size), np.empty(a.size)
    for k in range(a.size):
        ak, mk = a[k], m[k]

        # curve_fit fits as many parameters as p0 has: B alone (R0 fixed), or B and R0.
        def f(uu, b, r0k=prob.r0, ak=ak, mk=mk):
            return r0k + (ak - r0k) * special.expit(b * (uu - mk))

        if prob.r0 is not None:
            p0, lo, hi = [1.0], [prob.b_lo], [prob.b_hi]
        else:
            p0 = [1.0, float(np.clip(y[0], prob.r0_lo, min(ak, prob.r0_hi)))]
            lo, hi = [prob.b_lo, prob.r0_lo], [prob.b_hi, max(min(ak, prob.r0_hi), prob.r0_lo)]
            if hi[1] <= lo[1]:
                hi[1] = lo[1] + 1e-12
        p0 = np.clip(p0, lo, hi)
        try:
            # u is -inf at compute 0 (where f is R0): the point is data, not a bad value.
            p, _ = optimize.curve_fit(f, u, y, p0=p0, bounds=(lo, hi), check_finite=False)
        except (RuntimeError, ValueError):
            p = p0
        bs[k] = p[0]
        r0s[k] = prob.r0 if prob.r0 is not None else p[1]
        sses[k] = float(((y - f(u, *p)) ** 2).sum())
    return bs, r0s, sses


def _solve_cells(a, m, prob, opts):
    solver = _solve_b_curve_fit if opts.b_solver == "curve_fit" else _solve_b_vectorized
    # Chunk the cells so that [K, N] temporaries stay a few MB.
    step = max(1, 200_000 // max(prob.x.size, 1))
    out = [solver(a[i : i + step], m[i : i + step], prob) for i in range(0, a.size, step)]
    return tuple(np.concatenate(p) for p in zip(*out, strict=True))


def _grid_pass(a_vals, logc_vals, prob, opts):
    aa, mm = np.meshgrid(a_vals, logc_vals, indexing="ij")  # [nA, nC]
    b, r0, sse = _solve_cells(aa.ravel(), mm.ravel(), prob, opts)
    k = int(np.nanargmin(sse))
    i, j = np.unravel_index(k, aa.shape)
    return (float(aa.flat[k]), float(mm.flat[k]), float(b[k]), float(r0[k]), float(sse[k])), (i, j)


def _fit_grid(prob: _Problem, opts: SigmoidOptions) -> tuple[np.ndarray, list[str]]:
    """The paper's procedure; returns (A, log C_mid, B, R0) and reasons not to trust it."""
    notes = []
    a_data = np.linspace(prob.a_lo, prob.a_hi, opts.n_a)
    if prob.a_fixed is not None:
        a_vals = np.array([prob.a_fixed])
    else:
        a_vals = _grid_values(opts.a_grid, PAPER_A_GRID, a_data)
        a_vals = a_vals[(a_vals >= prob.a_lo) & (a_vals <= prob.a_hi)]
        if a_vals.size == 0:
            raise FitError(
                f"no A grid value lies in [{prob.a_lo:g}, {prob.a_hi:g}] (A is at least R0); "
                "use the data-relative A grid"
            )
    c_data = np.exp(np.linspace(prob.logc_lo, prob.logc_hi, opts.n_c_mid))
    c_vals = _grid_values(opts.c_mid_grid, PAPER_C_MID_GRID, c_data)
    logc = np.log(c_vals)
    (a, m, b, r0, _), (i, j) = _grid_pass(a_vals, logc, prob, opts)
    # An explicit (or the paper's) A grid may stop short of the box [R0, max]: its edge is a
    # result of the grid, not of the data.
    if a_vals.size > 1 and i in (0, a_vals.size - 1) and opts.a_grid != "data":
        notes.append(f"A = {a:g} is at the edge of the A grid [{a_vals[0]:g}, {a_vals[-1]:g}]")
    # (C_mid at the edge of its grid is the edge of its box: _assess reports it.)
    if opts.refine:
        # One zoom around the best cell: resolution of a fine grid at the cost of two coarse ones.
        a_z = a_vals[max(i - 1, 0) : i + 2]
        m_z = logc[max(j - 1, 0) : j + 2]
        a_z = np.linspace(a_z.min(), a_z.max(), 21) if a_z.size > 1 else a_z
        m_z = np.linspace(m_z.min(), m_z.max(), 21)
        (a, m, b, r0, _), _ = _grid_pass(a_z, m_z, prob, opts)
    return np.array([a, m, b, r0]), notes


# --------------------------------------------------------------------------- lsq method


def _free_mask(prob: _Problem) -> np.ndarray:
    return np.array([prob.a_fixed is None, True, True, prob.r0 is None])


def _bounds(prob: _Problem) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([prob.a_lo, prob.logc_lo, prob.b_lo, prob.r0_lo])
    hi = np.array([prob.a_hi, prob.logc_hi, prob.b_hi, prob.r0_hi])
    return lo, hi


def _full(prob: _Problem, p_free: np.ndarray, free: np.ndarray) -> np.ndarray:
    full = np.array([prob.a_fixed, np.nan, np.nan, prob.r0], dtype=float)  # None: NaN
    full[free] = p_free
    return full


def _least_squares(prob: _Problem, starts: Sequence[np.ndarray], max_nfev: int | None = None):
    """Bounded least squares over the free parameters of (A, log C_mid, B, R0)."""
    u, y = prob.u, prob.y
    finite = np.isfinite(u)
    free = _free_mask(prob)
    lo, hi = _bounds(prob)
    lo, hi = lo[free], hi[free]
    same = hi <= lo  # a degenerate box (e.g. R0 free but all y equal)
    hi = np.where(same, lo + 1e-12, hi)

    def fun(p):
        a, m, b, r0 = _full(prob, p, free)
        return r0 + (a - r0) * special.expit(b * (u - m)) - y

    def jac(p):
        a, m, b, r0 = _full(prob, p, free)
        s = special.expit(b * (u - m))
        cols = _jac_columns(s, np.where(finite, u - m, 0.0), a, b, r0)
        return np.stack([c for c, f in zip(cols, free, strict=True) if f], axis=1)

    x0s = [np.clip(np.asarray(s0, dtype=float)[free], lo, hi) for s0 in starts]
    x0s = [np.clip(x0, lo + 1e-9 * (hi - lo), hi - 1e-9 * (hi - lo)) for x0 in x0s]
    opts = {"method": "trf", "xtol": 1e-10, "ftol": 1e-12, "gtol": 1e-12, "max_nfev": max_nfev}
    best = lowest_cost(fun, x0s, jac=jac, bounds=(lo, hi), x_scale="jac", **opts)
    if best is None:
        raise FitError("least squares failed from every start")
    return _full(prob, best.x, free)


def lowest_cost(fun, starts, **kwargs):
    """scipy's least_squares from each start; the result of lowest cost (None if all failed)."""
    best = None
    for x0 in starts:
        try:
            r = optimize.least_squares(fun, x0, **kwargs)
        except (ValueError, np.linalg.LinAlgError):
            continue
        if best is None or r.cost < best.cost:
            best = r
    return best


def _jac_columns(s, t, a, b, r0) -> tuple:
    """dR / d(A, log C_mid, B, R0) from s = expit(B (u - log C_mid)) and t = u - log C_mid
    (0 at compute 0, where s is 0)."""
    ds = s * (1.0 - s) * (a - r0)
    return (s, -ds * b, ds * t, 1.0 - s)


def _starts(prob: _Problem, n: int) -> list[np.ndarray]:
    """Deterministic starts spread over the plausible region (not the whole box)."""
    y, u = prob.y, prob.u
    up = u[np.isfinite(u)]
    ymax, span = float(y.max()), float(np.ptp(y)) or 0.05
    a_c = [ymax + 0.1 * span, ymax + 0.5 * span, ymax + 1.5 * span]
    m_c = [float(np.quantile(up, 0.3)), float(np.quantile(up, 0.7)), float(up.max()) + 1.0]
    b_c = [1.0, 2.5]
    r0 = prob.r0 if prob.r0 is not None else float(y[0])
    out = []
    for b in b_c:
        for m in m_c:
            for a in a_c:
                out.append(np.array([a, m, b, r0]))
    # Order so that the first few starts already span A, C_mid and B.
    out.sort(key=lambda s: (a_c.index(s[0]) + m_c.index(s[1])) % 3)
    return out[:n]


def _fit_lsq(prob: _Problem, opts: SigmoidOptions) -> tuple[np.ndarray, list[str]]:
    """All starts at once by batch_lsq, then scipy's trust-region solver from the best."""
    starts = np.array(_starts(prob, opts.n_starts))
    p, cost = batch_lsq(prob, np.tile(prob.y, (len(starts), 1)), starts)
    best = p[int(np.argmin(cost))]
    return _least_squares(prob, [best]), []


SIGMOID_METHODS: dict[str, Callable[[_Problem, SigmoidOptions], tuple[np.ndarray, list[str]]]] = {
    "grid": _fit_grid,
    "lsq": _fit_lsq,
}


# --------------------------------------------------------------------------- assessment


# The most fit noise (rmse) allowed for "the run reached A's upper bound": within 2x this.
_CEILING_NOISE = 0.02
# The warning of a fit whose A sits on its upper bound without the data reaching it.
UNPINNED_A = "the data do not pin A"


def _assess(prob: _Problem, p: np.ndarray, sse: float) -> list[str]:
    """Reasons not to trust a fit; an empty list means none were found."""
    a, m, b, r0 = p
    n, k = prob.x.size, prob.n_params
    why = []
    if n == k:
        why.append(f"as many points as parameters ({n}): the fit interpolates, nothing checks it")
    y = prob.y
    sst = float(((y - y.mean()) ** 2).sum())
    if sst == 0.0:
        why.append("flat curve: every fitted point has the same value")
    elif n > k:
        f_stat = ((sst - sse) / (k - 1)) / max(sse / (n - k), 1e-300)
        p_val = float(stats.f.sf(f_stat, k - 1, n - k)) if sse > 0 else 0.0
        if p_val > _FLAT_P_VALUE:
            why.append(
                f"flat curve: the sigmoid explains no more than a constant (F-test p = {p_val:.2g})"
            )
    if a - r0 <= 0:
        why.append(f"no gain: A = {a:.4g} <= R0 = {r0:.4g}")
    tol = 1e-3
    if prob.a_fixed is None and a >= prob.a_hi - tol * max(prob.a_hi - prob.a_lo, 1e-9):
        # A run that reaches the ceiling (an easy task at 100%) pins A there; one that stops
        # short of it and is extrapolated onto the bound does not. The allowance is the
        # fit's noise, capped: an RL curve's residuals are dominated by its transient dips,
        # which say nothing about how close its best points came to the bound.
        noise = math.sqrt(sse / (n - k)) if n > k else 0.0
        if y.max() < prob.a_hi - 2 * min(max(noise, 1e-3), _CEILING_NOISE):
            why.append(f"A = {a:.4g} is at its upper bound {prob.a_hi:g}: {UNPINNED_A}")
    span = prob.logc_hi - prob.logc_lo
    if m <= prob.logc_lo + tol * span or m >= prob.logc_hi - tol * span:
        why.append(
            f"C_mid = {math.exp(m):.4g} is at the edge of its range "
            f"[{math.exp(prob.logc_lo):.4g}, {math.exp(prob.logc_hi):.4g}]"
        )
    lb_span = math.log(prob.b_hi / prob.b_lo)
    if math.log(b / prob.b_lo) < tol * lb_span or math.log(prob.b_hi / b) < tol * lb_span:
        why.append(f"B = {b:.4g} is at a bound of [{prob.b_lo:g}, {prob.b_hi:g}]")
    if math.exp(m) > prob.x.max():
        why.append(
            f"the curve has not reached its midpoint (C_mid = {math.exp(m):.4g} > last compute "
            f"{prob.x.max():.4g}): A is an extrapolation"
        )
    return why


def _finish(
    prob: _Problem,
    p: np.ndarray,
    opts: SigmoidOptions,
    *,
    r0_source: str,
    r0_count: int,
    notes: Sequence[str] = (),
    problems: Sequence[str] = (),
) -> SigmoidFit:
    a, m, b, r0 = (float(t) for t in p)
    pred = r0 + (a - r0) * special.expit(b * (prob.u - m))
    res = prob.y - pred
    sse = float((res**2).sum())
    sst = float(((prob.y - prob.y.mean()) ** 2).sum())
    problems = list(problems) + _assess(prob, p, sse)
    return SigmoidFit(
        R0=r0,
        A=a,
        B=b,
        C_mid=math.exp(m),
        x=prob.x,
        y=prob.y,
        residuals=res,
        sse=sse,
        r2=1.0 - sse / sst if sst > 0 else float("nan"),
        rmse=math.sqrt(sse / prob.x.size),
        n_params=prob.n_params,
        r0_source=r0_source,
        r0_count=r0_count,
        method=opts.method,
        reliable=not problems,
        warnings=tuple(list(notes) + problems),  # notes are informational only
        options=opts,
        problem=prob,
    )


# --------------------------------------------------------------------------- public API


def fit_sigmoid(
    x,
    y,
    *,
    r0: str | float | None = None,
    method: str | None = None,
    fit_start: float | None = None,
    options: SigmoidOptions | None = None,
    **kwargs,
) -> SigmoidFit:
    """Fit R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) to one curve.

    x: cumulative compute (>= 0, sorted); y: the metric. r0: 'first' (default) takes R0 from
    the first evaluation (which is then not fitted), 'fit' fits it, a number fixes it.
    method: 'grid' (default, the paper's) or 'lsq'. fit_start: points at lower compute are
    not fitted. Further keyword arguments are SigmoidOptions fields (a_grid, c_mid_grid,
    metric_range, b_bounds, ...); they override `options`.
    Raises FitError when the input cannot be fitted; returns a fit with reliable=False and
    warnings when it can be fitted but should not be trusted.
    """
    options = _merge_options(options, r0=r0, method=method, fit_start=fit_start, **kwargs)
    x, y = check_xy(x, y)
    if options.r0 == "first" and x.size == 0:
        raise FitError("empty curve")
    return _fit_pooled([(x, y)], options)


def _merge_options(options: SigmoidOptions | None, **kwargs) -> SigmoidOptions:
    given = {k: v for k, v in kwargs.items() if v is not None}
    unknown = set(given) - {f.name for f in dataclasses.fields(SigmoidOptions)}
    if unknown:
        raise FitError(
            f"unknown fit option(s) {sorted(unknown)}; known: "
            f"{[f.name for f in dataclasses.fields(SigmoidOptions)]}"
        )
    if options is None:
        return SigmoidOptions(**given)
    return dataclasses.replace(options, **given) if given else options


def fit_sigmoid_runs(
    runs: Sequence[tuple[Sequence[float], Sequence[float]]],
    *,
    options: SigmoidOptions | None = None,
    **kwargs,
) -> SigmoidFit:
    """One sigmoid through several runs of a recipe (seeds): their points pooled.

    With r0='first', R0 is the mean of the runs' first evaluations, which are not fitted.
    Keyword arguments are SigmoidOptions fields.
    """
    options = _merge_options(options, **kwargs)
    if not runs:
        raise FitError("no runs to fit")
    checked = []
    for xr, yr in runs:
        xr, yr = check_xy(xr, yr)
        if xr.size == 0:
            raise FitError("a run has no points")
        checked.append((xr, yr))
    return _fit_pooled(checked, options)


def _fit_pooled(runs: Sequence[tuple[np.ndarray, np.ndarray]], options) -> SigmoidFit:
    """The fit of runs (checked by check_xy; none empty with r0='first') with their points
    pooled and sorted by compute. With r0='first', R0 is the mean of the runs' first
    evaluations, which are not fitted."""
    problems = []
    if options.r0 == "first":
        r0_val, src, cnt = float(np.mean([yr[0] for _, yr in runs])), "first", len(runs)
        late = [float(xr[0]) for xr, _ in runs if xr[0] > 0]
        if late:
            # R0 is the base model's rate, R(0); an evaluation after training began is higher.
            problems.append(
                f"R0 is taken from a first evaluation at compute {min(late):.4g} > 0, not the "
                "base model's (compute 0); evaluate at step 0 or use r0='fit'"
            )
        runs = [(xr[1:], yr[1:]) for xr, yr in runs]
    elif options.r0 == "fit":
        r0_val, src, cnt = None, "fit", 0
    else:
        r0_val, src, cnt = float(options.r0), "given", 0
    x = np.concatenate([xr for xr, _ in runs])
    y = np.concatenate([yr for _, yr in runs])
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    prob, notes = _build_problem(x, y, options, r0=r0_val)
    p, method_problems = SIGMOID_METHODS[options.method](prob, options)
    problems += method_problems
    return _finish(prob, p, options, r0_source=src, r0_count=cnt, notes=notes, problems=problems)


def refit(fit: SigmoidFit, *, y=None, r0: float | None = None, a_fixed=None) -> SigmoidFit:
    """Refit a fit's own points (optionally with new y, R0 or a held A) by warm-started lsq."""
    prob = fit.problem
    if y is not None or r0 is not None:
        prob = prob.with_y(fit.y if y is None else np.asarray(y, float), r0)
    opts = fit.options
    start = np.array([fit.A, math.log(fit.C_mid), fit.B, fit.R0])
    if a_fixed is not None:
        a_fixed = float(a_fixed)
        lo = prob.r0 if prob.r0 is not None else opts.metric_range[0]
        hi = opts.metric_range[1]
        if not lo <= a_fixed <= hi:
            raise FitError(f"cannot hold A = {a_fixed:g}: outside [{lo:g}, {hi:g}] (R0 to max)")
        prob = dataclasses.replace(prob, a_fixed=a_fixed, a_lo=a_fixed, a_hi=a_fixed)
        opts = dataclasses.replace(opts, a_fixed=a_fixed)
        start[0] = a_fixed
        starts = [start] + _starts(prob, 6)
    else:
        starts = [start]
    p = _least_squares(prob, starts)
    return _finish(prob, p, opts, r0_source=fit.r0_source, r0_count=fit.r0_count)


def _replicate_starts(prob: _Problem, start, r0, n_rep: int):
    """(starts [R, 4] clipped into the box, box lows [R, 4], box highs [R, 4]): a fixed R0
    pins its column per replicate (and bounds A from below), a fixed A pins its own."""
    lo, hi = _bounds(prob)
    fixed_r0 = prob.r0 is not None
    lo_rep, hi_rep = np.tile(lo, (n_rep, 1)), np.tile(hi, (n_rep, 1))
    if fixed_r0:
        r0v = np.full(n_rep, prob.r0) if r0 is None else np.asarray(r0, dtype=float)
        lo_rep[:, 3] = hi_rep[:, 3] = r0v
        if prob.a_fixed is None:  # A >= R0, and each replicate has its own R0
            lo_rep[:, 0] = np.minimum(r0v, hi[0])
    theta = np.array(np.broadcast_to(np.asarray(start, dtype=float), (n_rep, 4)))
    if fixed_r0:
        theta[:, 3] = r0v
    if prob.a_fixed is not None:
        theta[:, 0] = prob.a_fixed
    return np.clip(theta, lo_rep, hi_rep), lo_rep, hi_rep


def _residual_fns(u, y, wt, finite, fi):
    """(residuals [R, N] and the sigmoid at theta, Jacobian [R, N, P] in the free columns
    `fi`) of the weighted sigmoid fit, for theta [R, 4] = (A, log C_mid, B, R0)."""

    def resid(th):
        a, m, b, r = (th[:, i : i + 1] for i in range(4))
        s = special.expit(b * (u - m))
        return (r + (a - r) * s - y) * wt, s

    def jac(th, s):
        a, m, b, r = (th[:, i : i + 1] for i in range(4))
        cols = _jac_columns(s, np.where(finite, u - m, 0.0), a, b, r)
        return np.stack([cols[i] * wt for i in fi], axis=2)  # [R, N, P]

    return resid, jac


def _lm_step(j, res, lam, eye) -> np.ndarray:
    """[R, P] Levenberg-Marquardt steps (Marquardt's diagonal scaling; a gradient step where
    the damped system is singular)."""
    jt = j.transpose(0, 2, 1)
    g = (jt @ res[:, :, None])[:, :, 0]
    h = jt @ j
    d = np.einsum("rpp->rp", h)
    a_mat = h + (lam[:, None] * np.maximum(d, 1e-12))[:, :, None] * eye
    try:
        return np.linalg.solve(a_mat, -g[:, :, None])[:, :, 0]
    except np.linalg.LinAlgError:
        return -g / np.maximum(d, 1e-12)


def batch_lsq(
    prob: _Problem,
    y: np.ndarray,
    start: np.ndarray,
    *,
    x: np.ndarray | None = None,
    r0: np.ndarray | None = None,
    w: np.ndarray | None = None,
    iters: int = 60,
) -> tuple[np.ndarray, np.ndarray]:
    """Many small fits at once: projected Levenberg-Marquardt, vectorized over replicates.

    y: [R, N] data of R replicates (x: [R, N] when they differ, else prob.x); r0: [R] a fixed
    R0 per replicate (prob's R0 when None and it is fixed); start: [4] or [R, 4] in
    (A, log C_mid, B, R0); w: [R, N] 0/1 weights (padding for replicates of unequal length).
    Returns params [R, 4] and SSE [R]. The bootstrap runs hundreds of
    refits of one curve; a Python loop of scipy calls costs 100x more.
    """
    y = np.atleast_2d(np.asarray(y, dtype=float))
    n_rep = y.shape[0]
    xx = prob.x if x is None else x
    with np.errstate(divide="ignore"):
        u = np.broadcast_to(np.log(xx), y.shape)
    finite = np.isfinite(u)
    free = _free_mask(prob)
    wt = np.ones(y.shape) if w is None else np.broadcast_to(np.asarray(w, dtype=float), y.shape)
    theta, lo_rep, hi_rep = _replicate_starts(prob, start, r0, n_rep)
    fi = np.flatnonzero(free)
    resid, jac = _residual_fns(u, y, wt, finite, fi)
    res, s = resid(theta)
    cost = (res**2).sum(1)
    lam = np.full(n_rep, 1e-3)
    eye = np.eye(fi.size)
    for _ in range(iters):
        j = jac(theta, s)
        step = _lm_step(j, res, lam, eye)
        cand = theta.copy()
        cand[:, fi] = np.clip(theta[:, fi] + step, lo_rep[:, fi], hi_rep[:, fi])
        res_c, s_c = resid(cand)
        cost_c = (res_c**2).sum(1)
        ok = cost_c < cost
        done = ~ok & (lam > 1e8) | ok & (cost - cost_c <= 1e-14 * np.maximum(cost, 1e-30))
        theta = np.where(ok[:, None], cand, theta)
        res = np.where(ok[:, None], res_c, res)
        s = np.where(ok[:, None], s_c, s)
        cost = np.where(ok, cost_c, cost)
        lam = np.where(ok, np.maximum(lam / 3.0, 1e-9), lam * 4.0)
        if done.all():
            break
    return theta, cost
