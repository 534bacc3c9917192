"""Grid specs: a base recipe, axes, constraints, a compute budget, seeds.

A spec is a Python file (in `experiments/` or anywhere) defining
`grid() -> GridSpec`, the way a recipe file defines `recipe() -> RunConfig`.
Every part is a frozen keyword-only dataclass checked in `__post_init__`;
`rl_jax.grid.expand` turns a spec into concrete runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_jax.config import ConfigError, check_range
from rl_jax.config._run import EXPERIMENTS_DIR, user_file_errors
from rl_jax.scaling import FitError, PaperFinding, SigmoidOptions, parse_fit_start

# Compute units a budget can be given in; each is also a curve-row counter, so
# the report can put the same unit on its x axis.
UNITS = ("rollouts", "generated_tokens", "flops")
REPORT_KINDS = ("compare", "isocompute")
# What GridSpec.warm_start_overrides may change: how the model computes, not the weights it
# holds or is initialized with, so the warm-up starts from the run's own initial weights.
WARM_START_KNOBS = ("model.compute_dtype", "model.fp32_lm_head")
_LABEL_OK = re.compile(r"^[A-Za-z0-9._+=-]+$")
# Longest grid or run name: a file name (255 bytes on common file systems) with room for
# a run's log file suffix, `.<attempt>.log`.
MAX_NAME = 240


def _pairs(d: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    items = d.items() if isinstance(d, Mapping) else d
    return tuple((str(k), _freeze(v)) for k, v in items)


def _freeze(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def value_label(v: Any) -> str:
    """Short text for a knob value in a run name: 0.001 -> 1e-3, True -> true."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        s = f"{v:g}".replace("e-0", "e-").replace("e+0", "e").replace("e+", "e")
        return s
    if isinstance(v, tuple | list):
        return "+".join(value_label(x) for x in v) or "none"
    return re.sub(r"[^A-Za-z0-9.+=-]+", "-", str(v)).strip("-") or "empty"


_KINDS = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, bool),
}


def _check_types(obj: Any, owner: str) -> None:
    """Each field of `obj` annotated int, float, str or bool holds one (an int for a
    float too): a ConfigError naming `owner.field`, before any comparison of its value."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        ok = _KINDS.get(hint)
        value = getattr(obj, name)
        if ok is not None and not ok(value):
            raise ConfigError(
                f"{owner}.{name}={value!r}: expected {hint.__name__}, got {type(value).__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class Point:
    """One value of an axis: the knobs it sets and free variables for constraints."""

    label: str
    overrides: tuple[tuple[str, Any], ...] = ()
    vars: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        _check_types(self, "axis point")
        if not _LABEL_OK.match(self.label):
            raise ConfigError(
                f"axis point label {self.label!r} must use only letters, digits and _ . + = -"
                " (it becomes part of run directory names)"
            )


@dataclass(frozen=True, kw_only=True)
class Axis:
    """A list of points; the grid is the product of its axes.

    Build one with `Axis.of` (one knob), `Axis.zipped` (several knobs moving
    together) or `Axis.variants` (named override sets, e.g. leave-one-out).
    """

    name: str
    points: tuple[Point, ...]

    def __post_init__(self):
        _check_types(self, "axis")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.name):
            raise ConfigError(f"axis name {self.name!r} must be an identifier (used in reports)")
        if not self.points:
            raise ConfigError(f"axis {self.name!r} has no points")
        labels = [p.label for p in self.points]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ConfigError(f"axis {self.name!r} repeats labels {dup}; labels must be unique")

    @classmethod
    def of(cls, key: str, values: Iterable[Any], *, name: str = "", short: str = "") -> Axis:
        """One knob over `values`: Axis.of("sampling.n", [8, 16], short="n") -> n8, n16."""
        leaf = key.split(".")[-1]
        short = short or leaf
        pts = tuple(
            Point(label=f"{short}{value_label(v)}", overrides=((key, _freeze(v)),)) for v in values
        )
        return cls(name=name or short, points=pts)

    @classmethod
    def zipped(cls, name: str, columns: Mapping[str, Iterable[Any]], *, short: str = "") -> Axis:
        """Several knobs stepping together: zipped("lr_b", {"train.lr": [..], "data.x": [..]})."""
        cols = {k: list(v) for k, v in columns.items()}
        lengths = {k: len(v) for k, v in cols.items()}
        if len(set(lengths.values())) > 1:
            raise ConfigError(f"zipped axis {name!r}: columns differ in length {lengths}")
        n = next(iter(lengths.values()), 0)
        pts = []
        for i in range(n):
            ov = tuple((k, _freeze(v[i])) for k, v in cols.items())
            label = (short or "") + "-".join(value_label(v) for _, v in ov)
            pts.append(Point(label=label, overrides=ov))
        return cls(name=name, points=tuple(pts))

    @classmethod
    def variants(
        cls,
        name: str,
        table: Mapping[str, Mapping[str, Any]],
        *,
        vars: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Axis:
        """Named override sets; `vars` gives each label free variables usable in constraints."""
        vars = dict(vars or {})
        unknown = sorted(set(vars) - set(table))
        if unknown:
            raise ConfigError(f"axis {name!r}: vars for unknown labels {unknown}")
        pts = tuple(
            Point(label=label, overrides=_pairs(ov), vars=_pairs(vars.get(label, {})))
            for label, ov in table.items()
        )
        return cls(name=name, points=pts)


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Training compute per run; train.steps (M) = floor(amount / compute of one step).

    Compute of one step is exact in rollouts (B_p * n). In generated tokens and
    FLOPs it is an upper bound from the length limits unless the mean lengths
    are given here (set them from a pilot run's curve rows).
    """

    amount: float
    unit: str = "rollouts"
    prompt_tokens: float = (
        0.0  # mean prompt tokens per rollout (0: sampling.max_prompt_len, or 64 if auto)
    )
    generated_tokens: float = 0.0  # mean generated tokens per rollout (0: max_new_tokens)

    def __post_init__(self):
        _check_types(self, "budget")
        if self.unit not in UNITS:
            raise ConfigError(f"budget unit {self.unit!r} is not one of {list(UNITS)}")
        if not (isinstance(self.amount, int | float) and math.isfinite(self.amount)):
            raise ConfigError(f"budget amount {self.amount!r} must be a finite number")
        if self.amount <= 0:
            raise ConfigError(f"budget amount {self.amount!r} must be > 0")
        for k in ("prompt_tokens", "generated_tokens"):
            # 0 = the length limit
            check_range("budget", k, getattr(self, k), lo=0.0)


@dataclass(frozen=True, kw_only=True)
class ReportSpec:
    """What the grid's report fits and compares."""

    kind: str = "compare"  # 'compare': one curve per axis point; 'isocompute': frontier
    x: str = "rollouts"  # curve column used as compute
    metric: str = "val/pass@1"
    baseline: str = ""  # compare: the group the others are measured against ('' = first)
    frontier: tuple[str, str] = ("sampling.n", "data.prompts_per_batch")  # isocompute cells
    split_by: str = ""  # isocompute: axis whose points get separate frontiers (e.g. 'split')
    fit_fraction: float = 0.5  # extrapolation check: fit on this fraction of compute
    n_boot: int = 200  # bootstrap resamples behind every interval
    # Options of every sigmoid fit of the grid (rl_jax.scaling.SigmoidOptions): R0 from each
    # run's first evaluation ('first') or fitted ('fit'), and the compute before which points
    # are left out (a number, or 'P%' of a run's last compute), as the paper leaves out its
    # runs' first ~1.5k GPU-hours.
    r0: str | float = "first"
    fit_start: float | str | None = None
    # compare: what a paper reports for each axis point against the baseline (rl-jax study
    # puts its own classification beside it)
    paper: tuple[tuple[str, PaperFinding], ...] | Mapping[str, PaperFinding] = ()
    # compare: differences taken seed by seed (rl_jax.scaling.analyse_study), for grids whose
    # recipes share each seed's start (the warm-up and the sampling seed)
    paired: bool = False

    def __post_init__(self):
        _check_types(self, "report")
        if self.kind not in REPORT_KINDS:
            raise ConfigError(f"report.kind={self.kind!r} is not one of {list(REPORT_KINDS)}")
        if not 0.0 < self.fit_fraction < 1.0:
            raise ConfigError(f"report.fit_fraction={self.fit_fraction!r} must be in (0, 1)")
        if self.n_boot < 20:
            raise ConfigError(f"report.n_boot={self.n_boot} is too few for intervals; use >= 20")
        if len(self.frontier) != 2:
            raise ConfigError(f"report.frontier={self.frontier!r} must name two knobs (n, B_p)")
        try:
            SigmoidOptions(r0=self.r0)
            parse_fit_start(self.fit_start, 1.0)
        except FitError as e:
            raise ConfigError(f"report: {e}") from None
        if isinstance(self.paper, Mapping):
            object.__setattr__(self, "paper", tuple(self.paper.items()))
        for label, finding in self.paper:
            if not isinstance(finding, PaperFinding):
                raise ConfigError(
                    f"report.paper[{label!r}] is {type(finding).__name__}, not PaperFinding"
                )


@dataclass(frozen=True, kw_only=True)
class EarlyStop:
    """Stop runs whose fitted asymptote cannot catch the current leader's.

    A run is judged once it has `min_points` evaluations and has spent
    `min_fraction` of its steps; it is stopped when the probability that its
    asymptote reaches the leader's falls below `threshold`.
    """

    threshold: float = 0.05
    min_fraction: float = 0.3
    min_points: int = 4
    every_s: float = 30.0

    def __post_init__(self):
        _check_types(self, "early_stop")
        if not 0.0 < self.threshold < 0.5:
            raise ConfigError(f"early_stop.threshold={self.threshold!r} must be in (0, 0.5)")
        if not 0.0 < self.min_fraction < 1.0:
            raise ConfigError(f"early_stop.min_fraction={self.min_fraction!r} must be in (0, 1)")
        if self.min_points < 3:
            raise ConfigError(f"early_stop.min_points={self.min_points} must be >= 3 (a fit)")
        check_range("early_stop", "every_s", self.every_s, lo=0.0, lo_open=True)


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What one run asks a Ray cluster for (the local backend runs `jobs` at a time)."""

    cpus: float = 1.0
    gpus: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()  # e.g. (("TPU", 4),)

    def __post_init__(self):
        _check_types(self, "resources")
        for k, v in (("cpus", self.cpus), ("gpus", self.gpus), *self.custom):
            check_range("resources", k, v, lo=0.0)


@dataclass(frozen=True, kw_only=True)
class GridSpec:
    """A grid of runs of one base recipe.

    Runs are the product of `axes`, times `seeds`, minus those that violate a
    constraint. Constraints are expressions over knobs (`sampling.n`), the
    aliases B_p, n, B (= B_p * n), M (train.steps after the budget) and the
    `vars` of the run's axis points, e.g. "B_p * n <= B_max".
    """

    name: str
    recipe: str
    base: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()
    axes: tuple[Axis, ...] = ()
    constraints: tuple[str, ...] = ()
    budget: Budget | None = None
    seeds: tuple[int, ...] = (0,)
    seed_keys: tuple[str, ...] = ("train.seed",)
    evals_per_run: int = 0  # > 0: eval.every = M // evals_per_run (0: the recipe's)
    checkpoints_per_run: int = 0  # > 0: checkpoint.every = M // this, so resumes lose little
    max_attempts: int = 3  # failed launches of one run before the grid gives up on it
    # > 0: each run starts from the CPU demo's supervised warm-up, stopped at this greedy
    # pass rate (rl_jax.cli.warm_train): the tiny model's random init cannot learn by RL.
    warm_start: float = 0.0
    # Knobs the warm-up runs with instead of the run's own: only how the model computes
    # (WARM_START_KNOBS), so that e.g. both arms of a precision ablation start from the
    # same float32 warm-up (rl_jax.cli.warm_train --warm-set).
    warm_start_overrides: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()
    resources: Resources = field(default_factory=Resources)
    report: ReportSpec = field(default_factory=ReportSpec)
    early_stop: EarlyStop | None = None
    description: str = ""

    def __post_init__(self):
        # The name is a directory under --out: '.' or '..' would put the grid in --out or
        # beside it.
        _check_types(self, "grid")
        if not re.match(r"^[A-Za-z0-9_.-]+$", self.name or "") or self.name in (".", ".."):
            raise ConfigError(
                f"grid name {self.name!r} must use only letters, digits, _ . - and not be"
                " '.' or '..' (it names the grid's directory under --out)"
            )
        if len(self.name) > MAX_NAME:
            raise ConfigError(
                f"grid name {self.name[:40]!r}... is {len(self.name)} characters; at most"
                f" {MAX_NAME} (it names the grid's directory)"
            )
        for k in ("base", "warm_start_overrides"):  # a mapping given: its (key, value) pairs
            if not isinstance(getattr(self, k), tuple):
                object.__setattr__(self, k, _pairs(getattr(self, k)))
        for k in ("axes", "constraints", "seeds", "seed_keys"):
            value = getattr(self, k)
            # One string or Axis where a sequence of them is meant: a string's characters
            # would each become a constraint or seed key, and an Axis is not iterable.
            if isinstance(value, str | int | Axis):
                raise ConfigError(
                    f"grid {self.name!r}: {k}={value!r} must be a tuple of them, e.g."
                    f" {k}=({value!r},)"
                )
            object.__setattr__(self, k, tuple(value))
        names = [a.name for a in self.axes]
        dup = sorted({x for x in names if names.count(x) > 1})
        if dup:
            raise ConfigError(f"grid {self.name!r}: axis names repeat {dup}")
        if not self.seeds:
            raise ConfigError(f"grid {self.name!r}: seeds is empty; give at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"grid {self.name!r}: seeds repeat {self.seeds}")
        if self.max_attempts < 1:
            raise ConfigError(f"grid {self.name!r}: max_attempts={self.max_attempts} must be >= 1")
        if not 0.0 <= self.warm_start < 1.0:
            raise ConfigError(f"grid {self.name!r}: warm_start={self.warm_start} must be in [0, 1)")
        for k, _ in self.warm_start_overrides:
            if k not in WARM_START_KNOBS:
                raise ConfigError(
                    f"grid {self.name!r}: warm_start_overrides key {k!r} is not one of"
                    f" {list(WARM_START_KNOBS)} (the warm-up must start from the run's own"
                    " initial weights)"
                )
        if self.warm_start_overrides and not self.warm_start:
            raise ConfigError(
                f"grid {self.name!r}: warm_start_overrides needs warm_start > 0 (there is no"
                " warm-up to override)"
            )
        for k in ("evals_per_run", "checkpoints_per_run"):
            if getattr(self, k) < 0:
                raise ConfigError(f"grid {self.name!r}: {k}={getattr(self, k)} must be >= 0")
        if self.report.split_by and self.report.split_by not in names:
            raise ConfigError(
                f"grid {self.name!r}: report.split_by={self.report.split_by!r} is not an axis;"
                f" axes: {names}"
            )

    def replace(self, **changes: Any) -> GridSpec:
        return dataclasses.replace(self, **changes)


def resolve_spec_path(spec: str) -> Path:
    """A path to a spec file, or a name in experiments/ (e.g. isocompute_cpu)."""
    p = Path(spec)
    if p.suffix == ".py":
        if p.exists():
            return p
        raise ConfigError(f"grid spec file {spec} does not exist")
    cand = EXPERIMENTS_DIR / f"{spec}.py"
    if cand.exists():
        return cand
    raise ConfigError(f"grid spec {spec!r} not found; known grid specs: {known_specs()}")


def known_specs() -> list[str]:
    """Files in experiments/ that define grid()."""
    out = []
    for q in sorted(EXPERIMENTS_DIR.glob("*.py")):
        if not q.stem.startswith("_") and "def grid(" in q.read_text(encoding="utf-8"):
            out.append(q.stem)
    return out


def load_spec(spec: str) -> GridSpec:
    """Load a spec file (`grid() -> GridSpec`); errors in it become ConfigError (exit 2)."""
    path = resolve_spec_path(spec)
    mod_spec = importlib.util.spec_from_file_location(f"rl_jax_grid_{path.stem}", path)
    module = importlib.util.module_from_spec(mod_spec)
    assert mod_spec.loader is not None
    with user_file_errors(path, "grid spec"):
        mod_spec.loader.exec_module(module)
    if not hasattr(module, "grid"):
        hint = (
            " (it looks like a recipe: run it with rl-jax train)"
            if hasattr(module, "recipe")
            else ""
        )
        raise ConfigError(f"{path} defines no grid() function{hint}")
    # An unknown GridSpec / Axis field surfaces as a TypeError (unexpected keyword argument).
    with user_file_errors(path, "grid spec"):
        g = module.grid()
    if not isinstance(g, GridSpec):
        raise ConfigError(f"{path}: grid() returned {type(g).__name__}, not GridSpec")
    return g
