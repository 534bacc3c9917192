"""A seeded leave-one-out study: is each variant's (A, B) different from the baseline's?

ScaleRL's leave-one-out (LOO) ablations revert one component at a time and ask
whether the asymptote A or the efficiency B moves (PAPERS.md section 1). With a
few seeds per variant the question is statistical, and this module answers it
from the per-seed fits:

- seed noise: each run (one seed) is fitted alone; the spread of A and B over a
  recipe's seeds, pooled over recipes, is the run-to-run noise;
- a variant's effect on A is the difference of its seed-mean A from the
  baseline's, with a Student-t interval from the pooled seed variance (every
  recipe contributes its seeds' degrees of freedom);
- its effect on B follows the paper's rule: both recipes' runs are refitted at
  their common A (the mean of their pooled fits' A) and the seed-mean B at that
  A is compared, with a t interval from the two recipes' seeds;
- the classification: A 'higher'/'lower' when its interval excludes zero and
  the difference exceeds the paper's +-0.02 tie band, 'tie' when the whole
  interval lies inside the band, 'differs within band' when it excludes zero
  inside the band, otherwise 'not resolved'; B 'higher'/'lower' when its
  interval excludes zero; 'identical' when every seed's curve equals the
  baseline's bit for bit (the component cannot act in this setting); 'not
  resolved (A unpinned)' when a run's fit puts A on its upper bound without
  the curve reaching it (such runs are also left out of the seed noise of A);
- paired=True, for designs whose recipes share each seed's start (the same
  warm-up, the same sampling seed): the differences are taken seed by seed,
  variant minus baseline, with a t interval from their spread (seeds - 1
  degrees of freedom), and the classes come from those intervals. A seed's
  start then cancels out of the difference; with few seeds the wider t
  quantile can cost more than that gains;
- half-budget extrapolation for every run and for the baseline's seed-mean
  curve (rl_jax.scaling.extrapolation_check).

Every number comes from deterministic code (fixed bootstrap seeds), so a
report regenerates bit for bit from its curves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from rl_jax.scaling._compare import PAPER_A_TOL
from rl_jax.scaling._curves import Curve, group_curves
from rl_jax.scaling._extrapolate import Extrapolation, extrapolation_check
from rl_jax.scaling._report import FitReport, fit_runs, parse_fit_start
from rl_jax.scaling._sigmoid import UNPINNED_A, FitError, SigmoidFit, refit

DIRECTIONS = ("higher", "lower", "tie", "")


@dataclass(frozen=True)
class PaperFinding:
    """What a paper reports for a variant against the baseline."""

    a: str  # the variant's A: 'higher', 'lower', 'tie' (within the tie band) or '' (not reported)
    b: str  # the variant's B, same words
    note: str = ""

    def __post_init__(self):
        for k in ("a", "b"):
            if getattr(self, k) not in DIRECTIONS:
                raise ValueError(f"PaperFinding.{k}={getattr(self, k)!r}: use one of {DIRECTIONS}")


@dataclass(frozen=True, kw_only=True)
class SeedFit:
    group: str
    seed: Any
    run_id: str
    fit: SigmoidFit
    extrapolation: Extrapolation | None = None  # the run's half-budget check

    @property
    def a_pinned(self) -> bool:
        """False when A sits on its upper bound without the curve reaching it: then A is
        not an estimate, and neither noise nor differences can be read from it."""
        return not any(UNPINNED_A in w for w in self.fit.warnings)


@dataclass(frozen=True, kw_only=True)
class Effect:
    """One variant against the baseline."""

    group: str
    seeds: int
    dA: float
    dA_interval: tuple[float, float]
    a_common: float
    dB: float  # seed-mean B at a_common, variant minus baseline
    dB_interval: tuple[float, float]
    a_class: str
    b_class: str
    a_exceeds_noise: bool  # |dA| > 2 standard errors of seed noise
    b_exceeds_noise: bool
    paper: PaperFinding | None
    verdict: str
    # paired: the seeds compared (in both recipes); dA and dB above are means of per-seed
    # differences, and these are the pooled (unpaired) intervals, for comparison
    paired_seeds: int = 0
    dA_interval_unpaired: tuple[float, float] | None = None
    dB_interval_unpaired: tuple[float, float] | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class Study:
    baseline: str
    level: float
    a_tol: float
    report: FitReport  # per-run and pooled fits, the recipe table, per-run extrapolations
    seed_fits: dict[str, list[SeedFit]]
    noise: dict[str, float]  # pooled seed noise: sd_A, df_A, sd_B, df_B
    effects: list[Effect]
    baseline_mean: Extrapolation | None
    baseline_mean_note: str
    notes: list[str] = field(default_factory=list)
    paired: bool = False


def _t_interval(diff: float, se: float, df: int, level: float) -> tuple[float, float]:
    if df < 1 or not math.isfinite(se):
        return (-math.inf, math.inf)
    q = float(stats.t.ppf((1 + level) / 2, df))
    return (diff - q * se, diff + q * se)


def _pooled_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int]:
    """Pooled within-group standard deviation and its degrees of freedom."""
    ss, df = 0.0, 0
    for g in groups:
        if len(g) >= 2:
            g = np.asarray(g, float)
            ss += float(((g - g.mean()) ** 2).sum())
            df += len(g) - 1
    return (math.sqrt(ss / df), df) if df else (math.nan, 0)


def classify_a(lo: float, hi: float, diff: float, a_tol: float) -> str:
    if lo > 0 or hi < 0:
        if abs(diff) > a_tol:
            return "higher" if diff > 0 else "lower"
        return "differs within band"
    if -a_tol <= lo and hi <= a_tol:
        return "tie"
    return "not resolved"


def classify_b(lo: float, hi: float, diff: float) -> str:
    if lo > 0 or hi < 0:
        return "higher" if diff > 0 else "lower"
    return "not resolved"


def verdict(a_class: str, b_class: str, paper: PaperFinding | None) -> str:
    """Our classification against the paper's, in one phrase."""
    if a_class == "identical":
        return "cannot differ in this setting"
    if paper is None:
        return "no paper finding"
    if a_class.startswith("not resolved"):
        return "not resolved at this scale"
    ours_a = "tie" if a_class in ("tie", "differs within band") else a_class
    if paper.a and ours_a != paper.a:
        return "disagrees on A"
    if ours_a in ("higher", "lower") or not paper.b:
        return "agrees"
    if b_class == "not resolved":
        return "agrees on A; B not resolved"
    return "agrees" if b_class == paper.b else "disagrees on B"


def _seed_of(c: Curve) -> Any:
    s = c.meta.get("seed", c.meta.get("train.seed"))
    return c.run_id if s is None else s


def _identical(a: list[Curve], b: list[Curve]) -> bool:
    by_seed = {_seed_of(c): c for c in b}
    return bool(a) and all(
        _seed_of(c) in by_seed
        and np.array_equal(c.x, by_seed[_seed_of(c)].x)
        and np.array_equal(c.y, by_seed[_seed_of(c)].y)
        for c in a
    )


def mean_curve(curves: Sequence[Curve]) -> tuple[np.ndarray, np.ndarray]:
    """The seed-mean curve over the evaluation steps every run has: mean x and mean y."""
    steps = [c.steps if c.steps is not None else np.arange(c.x.size) for c in curves]
    common = sorted(set.intersection(*(set(s.tolist()) for s in steps)))
    if not common:
        raise FitError("the runs share no evaluation step")
    xs, ys = [], []
    for c, s in zip(curves, steps, strict=True):
        idx = [int(np.flatnonzero(s == k)[0]) for k in common]
        xs.append(c.x[idx])
        ys.append(c.y[idx])
    return np.mean(xs, axis=0), np.mean(ys, axis=0)


def _diff_interval(d: Sequence[float], level: float) -> tuple[float, float, tuple]:
    """Mean of paired differences, its standard error and t interval (n - 1 df)."""
    d = np.asarray(d, float)
    if d.size < 2:
        return (float(d.mean()) if d.size else math.nan), math.nan, (-math.inf, math.inf)
    se = float(d.std(ddof=1)) / math.sqrt(d.size)
    return float(d.mean()), se, _t_interval(float(d.mean()), se, d.size - 1, level)


def _b_at_common(base: list[SeedFit], var: list[SeedFit], common: float) -> dict[str, float]:
    """{run_id: B refitted at the common A} of the runs whose R0 lies below it."""
    b_at: dict[str, float] = {}
    for s in (*base, *var):
        try:
            b_at[s.run_id] = refit(s.fit, a_fixed=common).B
        except FitError:
            continue  # the run's R0 lies above the common A: it says nothing about B there
    return b_at


def _b_difference(b_at, base: list[SeedFit], var: list[SeedFit], level: float):
    """(dB, its standard error, its t interval) between the two recipes' mean B at the
    common A, unpaired; NaN with an unbounded interval where a side has no B."""
    b_b = [b_at[s.run_id] for s in base if s.run_id in b_at]
    b_v = [b_at[s.run_id] for s in var if s.run_id in b_at]
    if not (b_b and b_v):
        return math.nan, math.nan, (-math.inf, math.inf)
    return _unpaired(b_b, b_v, *_pooled_sd([b_b, b_v]), level)


def _unpaired(base, var, sd: float, df: int, level: float):
    """(mean(var) - mean(base), its standard error from the pooled sd, its t interval)."""
    d = float(np.mean(var) - np.mean(base))
    se = sd * math.sqrt(1 / len(var) + 1 / len(base))
    return d, se, _t_interval(d, se, df, level)


def _effect(
    group: str,
    base: list[SeedFit],
    var: list[SeedFit],
    pooled: Mapping[str, SigmoidFit],
    sd_a: float,
    df_a: int,
    *,
    level: float,
    a_tol: float,
    identical: bool,
    paper: PaperFinding | None,
    paired: bool = False,
) -> Effect:
    d_a, se_a, a_ci = _unpaired([s.fit.A for s in base], [s.fit.A for s in var], sd_a, df_a, level)
    common = (pooled[group].A + pooled[base[0].group].A) / 2
    b_at = _b_at_common(base, var, common)
    d_b, se_b, b_ci = _b_difference(b_at, base, var, level)
    extra: dict[str, Any] = {}
    if paired:
        by_seed = {s.seed: s for s in base}
        pairs = [(by_seed[v.seed], v) for v in var if v.seed in by_seed]
        unpaired = {"dA_interval_unpaired": a_ci, "dB_interval_unpaired": b_ci}
        d_a, se_a, a_ci = _diff_interval([v.fit.A - b.fit.A for b, v in pairs], level)
        d_b, se_b, b_ci = _diff_interval(
            [
                b_at[v.run_id] - b_at[b.run_id]
                for b, v in pairs
                if {b.run_id, v.run_id} <= b_at.keys()
            ],
            level,
        )
        extra = {"paired_seeds": len(pairs), **unpaired}
    if identical:
        a_class = b_class = "identical"
    elif not all(s.a_pinned for s in (*base, *var)):
        a_class, b_class = "not resolved (A unpinned)", classify_b(*b_ci, d_b)
    else:
        a_class, b_class = classify_a(*a_ci, d_a, a_tol), classify_b(*b_ci, d_b)
    return Effect(
        group=group,
        seeds=len(var),
        dA=d_a,
        dA_interval=a_ci,
        a_common=float(common),
        dB=d_b,
        dB_interval=b_ci,
        a_class=a_class,
        b_class=b_class,
        a_exceeds_noise=bool(math.isfinite(se_a) and abs(d_a) > 2 * se_a),
        b_exceeds_noise=bool(math.isfinite(se_b) and abs(d_b) > 2 * se_b),
        paper=paper,
        verdict=verdict(a_class, b_class, paper),
        **extra,
    )


def _seed_fits(groups, report, notes: list[str]) -> dict[str, list[SeedFit]]:
    """{group: its runs' fits with their seeds}; a run that could not be fitted is noted."""
    by_run = {e.name: e for e in report.entries if e.kind == "run"}
    seed_fits: dict[str, list[SeedFit]] = {}
    for g, runs in groups.items():
        seed_fits[g] = []
        for c in runs:
            e = by_run[c.run_id]
            if e.fit is None:
                notes.append(f"run {c.run_id} ({g}) could not be fitted: {e.error}")
                continue
            seed_fits[g].append(
                SeedFit(
                    group=g,
                    seed=_seed_of(c),
                    run_id=c.run_id,
                    fit=e.fit,
                    extrapolation=e.extrapolation,
                )
            )
    return seed_fits


def _seed_noise(seed_fits: dict[str, list[SeedFit]], notes: list[str]) -> dict[str, Any]:
    """The seed noise of A (runs with A pinned below its bound only) and B, pooled over
    recipes, with its degrees of freedom; the runs left out are noted."""
    sd_a, df_a = _pooled_sd([[s.fit.A for s in v if s.a_pinned] for v in seed_fits.values()])
    unpinned = [s.run_id for v in seed_fits.values() for s in v if not s.a_pinned]
    if unpinned:
        notes.append(
            f"{len(unpinned)} run(s) with A on its upper bound, left out of the seed noise of A "
            f"and leaving their recipes' A differences unresolved: {', '.join(unpinned)}"
        )
    sd_b, df_b = _pooled_sd([[s.fit.B for s in v] for v in seed_fits.values()])
    return {"sd_A": sd_a, "df_A": df_a, "sd_B": sd_b, "df_B": df_b}


def _effects(groups, baseline, seed_fits, pooled, noise, notes, *, level, a_tol, paper, paired):
    """Every recipe's Effect against the baseline; one without fits is noted instead."""
    effects = []
    for g in groups:
        if g == baseline:
            continue
        missing = [h for h in (g, baseline) if not seed_fits[h] or h not in pooled]
        if missing:
            notes.append(f"{g}: not compared; no fit of {' and '.join(missing)}")
            continue
        effects.append(
            _effect(
                g,
                seed_fits[baseline],
                seed_fits[g],
                pooled,
                noise["sd_A"],
                noise["df_A"],
                level=level,
                a_tol=a_tol,
                identical=_identical(groups[g], groups[baseline]),
                paper=paper.get(g),
                paired=paired,
            )
        )
    return effects


def _baseline_mean(runs, *, fraction, n_boot, level, seed, r0, fit_start):
    """(the extrapolation check of the baseline's mean curve, "") or (None, why not)."""
    try:
        mx, my = mean_curve(runs)
        start = parse_fit_start(fit_start, float(mx[-1]))
        return extrapolation_check(
            mx, my, fraction=fraction, n_boot=n_boot, level=level, seed=seed, r0=r0,
            fit_start=start,
        ), ""  # fmt: skip
    except FitError as e:
        return None, str(e)


def analyse_study(
    curves: Sequence[Curve],
    *,
    baseline: str,
    paper: Mapping[str, PaperFinding] | None = None,
    level: float = 0.95,
    a_tol: float = PAPER_A_TOL,
    fraction: float = 0.5,
    n_boot: int = 200,
    seed: int = 0,
    r0: str | float = "first",
    fit_start: float | str | None = None,
    paired: bool = False,
) -> Study:
    """Fit a seeded LOO study: curves are grouped by Curve.group, seeds from the `seed` column.

    r0, fit_start: the sigmoid options of every fit (fit_start: a compute, or 'P%' of each
    run's last compute). paired: differences seed by seed (recipes share each seed's start)."""
    groups = group_curves(curves)
    if baseline not in groups:
        raise FitError(f"baseline {baseline!r} has no curves; groups: {sorted(groups)}")
    report = fit_runs(
        list(curves),
        n_boot=n_boot,
        level=level,
        extrapolate=fraction,
        a_tol=a_tol,
        seed=seed,
        r0=r0,
        fit_start=fit_start,
    )
    notes: list[str] = []
    seed_fits = _seed_fits(groups, report, notes)
    noise = _seed_noise(seed_fits, notes)
    pooled = {g: e.fit for g, e in report.recipes.items() if e.fit is not None}
    effects = _effects(
        groups, baseline, seed_fits, pooled, noise, notes,
        level=level, a_tol=a_tol, paper=paper or {}, paired=paired,
    )  # fmt: skip
    mean_ext, mean_note = _baseline_mean(
        groups[baseline], fraction=fraction, n_boot=n_boot, level=level, seed=seed, r0=r0,
        fit_start=fit_start,
    )  # fmt: skip
    return Study(
        baseline=baseline,
        level=level,
        a_tol=a_tol,
        report=report,
        seed_fits=seed_fits,
        noise=noise,
        effects=effects,
        baseline_mean=mean_ext,
        baseline_mean_note=mean_note,
        notes=notes,
        paired=paired,
    )
