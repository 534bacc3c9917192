"""Expand a GridSpec into concrete runs: resolved configs, stable ids, steps from the budget."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import itertools
import json
import math
import operator
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rl_jax.config import (
    ConfigError,
    RunConfig,
    all_keys,
    apply_overrides,
    flatten,
    load_recipe,
    resolved,
    run_id,
)
from rl_jax.grid.spec import MAX_NAME, Budget, GridSpec

# Constraint aliases (IsoCompute's letters) -> how to compute them from a config.
ALIASES = {
    "B_p": lambda c: c.data.prompts_per_batch,
    "n": lambda c: c.sampling.n,
    "B": lambda c: c.data.prompts_per_batch * c.sampling.n,
    "M": lambda c: c.train.steps,
}


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """One run of a grid, fully resolved."""

    index: int
    name: str  # directory name: readable axis summary + run id
    run_id: str
    group: str  # axis labels without the seed: runs of one group differ only in seed
    labels: tuple[tuple[str, str], ...]  # axis name -> point label
    seed: int
    overrides: tuple[str, ...]  # key=value for `rl-jax train RECIPE ...` (no name/out_dir)
    config: RunConfig
    step_compute: dict[str, float]  # compute of one step per unit (nan: unknown)

    @property
    def steps(self) -> int:
        return self.config.train.steps

    @property
    def compute(self) -> dict[str, float]:
        """Estimated training compute of the whole run, per unit."""
        return {k: v * self.steps for k, v in self.step_compute.items()}

    def train_args(self, recipe_path: str, *, out_dir: str, extra: Sequence[str] = ()) -> list[str]:
        """Arguments after `rl-jax train`: the recipe, every override, then `extra` (values
        the config already holds, spelled out for a backend), then where to write."""
        return [recipe_path, *self.overrides, *extra, f"name={self.name}", f"out_dir={out_dir}"]


# ---- override formatting --------------------------------------------------------------


def format_override(key: str, value: Any) -> str:
    """`key=value` that OmegaConf parses back to exactly `value`."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, tuple | list):
        text = json.dumps(list(value))
    elif isinstance(value, str):
        if "${" in value:
            raise ConfigError(f"{key}={value!r}: '${{' would be read as an OmegaConf interpolation")
        # Quoted so that '01' stays a string and ': ' is not YAML syntax: single quotes,
        # or for text YAML's single quotes cannot hold (they fold a line break into a
        # space; control characters), a double-quoted JSON string with escapes.
        if value.isprintable():
            text = "'" + value.replace("'", "''") + "'"
        else:
            text = json.dumps(value, ensure_ascii=False)
    else:
        raise ConfigError(f"{key}={value!r}: cannot pass a {type(value).__name__} as an override")
    return f"{key}={text}"


# ---- constraints ----------------------------------------------------------------------

_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
_CMP = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


class Constraint:
    """A boolean expression over knobs, aliases and point vars, parsed once, evaluated safely."""

    def __init__(self, text: str):
        self.text = text
        try:
            self._tree = ast.parse(text, mode="eval")
        except SyntaxError as e:
            raise ConfigError(f"constraint {text!r} is not an expression: {e.msg}") from e
        self.names = sorted({n for n in self._names(self._tree.body)})

    def _names(self, node: ast.AST):
        name = _dotted(node)
        if name is not None:
            yield name
            return
        for child in ast.iter_child_nodes(node):
            yield from self._names(child)

    def check_names(self, known: set[str]) -> None:
        unknown = [n for n in self.names if n not in known]
        if unknown:
            aliases = ", ".join(sorted(ALIASES))
            raise ConfigError(
                f"constraint {self.text!r}: unknown name(s) {unknown}; use config keys"
                f" (e.g. sampling.n), the aliases {aliases}, or vars of the axis points"
            )

    def __call__(self, env: dict[str, Any]) -> bool:
        try:
            return bool(self._eval(self._tree.body, env))
        except KeyError as e:
            raise ConfigError(
                f"constraint {self.text!r}: {e.args[0]!r} has no value here (a var that only"
                " some axis points give); give it on every point of the axis"
            ) from None
        except (ArithmeticError, TypeError, ValueError) as e:
            raise ConfigError(f"constraint {self.text!r}: {type(e).__name__}: {e}") from None

    def _eval(self, node: ast.AST, env: dict[str, Any]) -> Any:
        name = _dotted(node)
        if name is not None:
            return env[name]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            return _BIN[type(node.op)](self._eval(node.left, env), self._eval(node.right, env))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand, env))
        if isinstance(node, ast.BoolOp):
            vals = (self._eval(v, env) for v in node.values)
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        if isinstance(node, ast.Compare) and all(type(o) in _CMP for o in node.ops):
            left = self._eval(node.left, env)
            for op, comp in zip(node.ops, node.comparators, strict=True):
                right = self._eval(comp, env)
                if not _CMP[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            branch = node.body if self._eval(node.test, env) else node.orelse
            return self._eval(branch, env)
        if isinstance(node, ast.Tuple | ast.List):
            return tuple(self._eval(e, env) for e in node.elts)
        raise ConfigError(
            f"constraint {self.text!r}: {type(node).__name__} is not allowed; use arithmetic,"
            " comparisons, and/or/not, x if c else y"
        )


# ---- compute --------------------------------------------------------------------------


def step_compute(cfg: RunConfig, budget: Budget | None = None) -> dict[str, float]:
    """Compute of one RL step in each unit: rollouts exact; tokens and FLOPs from the
    budget's expected lengths (else the config's caps), by the count runs use
    (`rl_jax.train.accounting.step_flops`); FLOPs nan if the model code is not in
    this build."""
    rollouts = cfg.data.prompts_per_batch * cfg.sampling.n
    # sampling.max_prompt_len=0 (auto, known only from the data): the former default cap.
    p = (budget.prompt_tokens if budget else 0) or cfg.sampling.max_prompt_len or 64
    g = (budget.generated_tokens if budget else 0) or cfg.sampling.max_new_tokens
    try:
        from rl_jax.models.load import resolve_spec
    except ImportError:
        flops = math.nan
    else:
        from rl_jax.train.accounting import step_flops

        P = cfg.data.prompts_per_batch
        f = step_flops(resolve_spec(cfg.model), cfg, [p] * P, [g] * rollouts)
        flops = f["sampler_flops"] + f["trainer_flops"]
    return {
        "rollouts": float(rollouts),
        "generated_tokens": float(rollouts * g),
        "flops": flops,
    }


# ---- expansion ------------------------------------------------------------------------


def _at(where: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` (a config with overrides or values set, a constraint's verdict), `where`
    put before a ConfigError's message."""
    try:
        return fn(*args)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """`value` as the field's type, accepting what OmegaConf accepts from its text form."""
    origin = typing.get_origin(typ)
    ok = True
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif typ is str:
        ok = isinstance(value, str)
    elif origin is list:
        (item,) = typing.get_args(typ)
        ok = isinstance(value, list | tuple)
        value = [_coerce(key, v, item) for v in value] if ok else value
    if not ok:
        name = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"{key}={value!r}: expected {name}, got {type(value).__name__}")
    return value


def with_values(cfg: Any, pairs: Sequence[tuple[str, Any]]) -> Any:
    """`cfg` with dotted keys set to Python values (re-validated by each __post_init__).

    The typed equivalent of `apply_overrides(cfg, [format_override(k, v), ...])`,
    without OmegaConf's cost (a grid resolves hundreds of configs); a test holds
    the two to the same run ids.
    """
    tree: dict[str, Any] = {}
    for key, value in pairs:
        node = tree
        *head, leaf = key.split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _replace(cfg, tree, "")


def _replace(obj: Any, tree: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(type(obj))
    changes = {}
    for name, sub in tree.items():
        key = prefix + name
        if name not in hints:
            raise ConfigError(f"unknown config key {key!r}")
        if isinstance(sub, dict):
            changes[name] = _replace(getattr(obj, name), sub, key + ".")
        else:
            changes[name] = _coerce(key, sub, hints[name])
    return dataclasses.replace(obj, **changes)


def _suggest(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def expand(spec: GridSpec, *, extra: Sequence[str] = ()) -> list[RunPlan]:
    """All runs of `spec`, in a stable order. `extra`: overrides a backend adds to every run.

    Raises ConfigError (exit 2) for unknown keys, constraints no run satisfies,
    and a budget smaller than one step.
    """
    recipe = load_recipe(spec.recipe)
    constraints = [Constraint(c) for c in spec.constraints]
    owners = _owners(spec, constraints, extra)
    base_ov = [format_override(k, v) for k, v in spec.base] + list(extra)
    end_only = "checkpoint.every" not in owners and not any(
        o.split("=", 1)[0].strip() == "checkpoint.every" for o in base_ov
    )
    base_cfg = _at(f"grid {spec.name!r} base", apply_overrides, recipe, base_ov)

    plans: list[RunPlan] = []
    dropped: list[str] = []
    too_small: list[str] = []
    for combo in itertools.product(*(a.points for a in spec.axes)):
        pairs = [kv for p in combo for kv in p.overrides]
        labels = tuple((a.name, p.label) for a, p in zip(spec.axes, combo, strict=True))
        group = "_".join(p.label for p in combo) or "base"
        where = f"grid {spec.name!r} run {group}"
        for seed in spec.seeds:
            point = pairs + [(k, seed) for k in spec.seed_keys]
            cfg = _at(where, with_values, base_cfg, point)
            per_step = step_compute(cfg, spec.budget)
            steps, derived = _derived(spec, cfg, per_step, end_only)
            env = _constraint_env(cfg, combo, steps)
            failed = [c.text for c in constraints if not _at(where, c, env)]
            if failed:
                dropped.append(f"{group} (fails {failed[0]!r})")
                continue
            if steps < 1:
                too_small.append(f"{group}: one step is {per_step[spec.budget.unit]:g}")
                continue
            cfg = _at(where, with_values, cfg, derived)
            overrides = tuple(base_ov + [format_override(k, v) for k, v in point + derived])
            rid = run_id(cfg)
            summary = "_".join([p.label for p in combo] + [f"s{seed}"])
            plans.append(
                RunPlan(
                    index=len(plans),
                    name=f"{summary}-{rid}",
                    run_id=rid,
                    group=group,
                    labels=labels,
                    seed=seed,
                    overrides=overrides,
                    config=cfg,
                    step_compute=per_step,
                )
            )
    _check_plans(spec, plans, dropped, too_small)
    return plans


def _owners(spec: GridSpec, constraints: list[Constraint], extra: Sequence[str]) -> dict:
    """{config key: what sets it (an axis, "seed_keys", or the spec field it is derived
    from)}; unknown keys, a key two owners set and an `extra` override that fights an
    owner refused."""
    known = set(all_keys())
    var_names = {k for a in spec.axes for p in a.points for k, _ in p.vars}
    for c in constraints:
        c.check_names(known | set(ALIASES) | var_names)
    owners: dict[str, str] = {k: "seed_keys" for k in spec.seed_keys}
    for k in spec.seed_keys:
        if k not in known:
            raise ConfigError(f"grid {spec.name!r}: seed key {k!r} is not a config key")
    for a in spec.axes:
        for p in a.points:
            for k, _ in p.overrides:
                if k not in known:
                    raise ConfigError(
                        f"grid {spec.name!r} axis {a.name!r}: unknown config key {k!r}"
                        + _suggest(k, known)
                    )
                if owners.setdefault(k, a.name) != a.name:
                    raise ConfigError(
                        f"grid {spec.name!r}: key {k!r} is set by {owners[k]!r} and {a.name!r}"
                    )
    derived_keys = {
        "train.steps": spec.budget is not None and "budget",
        "eval.every": spec.evals_per_run > 0 and "evals_per_run",
        "checkpoint.every": spec.checkpoints_per_run > 0 and "checkpoints_per_run",
    }
    for k, source in derived_keys.items():
        if not source:
            continue
        if k in owners:
            raise ConfigError(
                f"grid {spec.name!r}: {k!r} is set by {owners[k]!r} and derived from {source}"
            )
        owners[k] = source
    for item in extra:
        k = item.split("=", 1)[0].strip()
        if k in owners:
            raise ConfigError(f"override {item!r} fights grid {spec.name!r} {owners[k]!r}")
    return owners


def _derived(
    spec: GridSpec, cfg: RunConfig, per_step: dict[str, float], end_only: bool
) -> tuple[int, list[tuple[str, Any]]]:
    """A run's steps (from the budget, else its config) and the keys derived from the
    spec: train.steps, eval.every, checkpoint.every."""
    derived: list[tuple[str, Any]] = []
    if spec.budget is not None:
        per = per_step[spec.budget.unit]
        if math.isnan(per):
            raise ConfigError(
                f"grid {spec.name!r}: budget unit {spec.budget.unit!r} needs the model's"
                " FLOPs per token (rl_jax.models.spec), not in this build; use rollouts"
                " or generated_tokens"
            )
        steps = int(math.floor(spec.budget.amount / per + 1e-9))
        derived.append(("train.steps", steps))
    else:
        steps = cfg.train.steps
    if spec.evals_per_run:
        derived.append(("eval.every", max(1, steps // spec.evals_per_run)))
    if spec.checkpoints_per_run:
        derived.append(("checkpoint.every", max(1, steps // spec.checkpoints_per_run)))
    elif end_only:
        # No checkpoints_per_run: one checkpoint at the end, whatever the recipe's
        # interval (a shipped recipe checkpoints for runs launched by hand).
        derived.append(("checkpoint.every", 0))
    return steps, derived


def _constraint_env(cfg: RunConfig, combo, steps: int) -> dict[str, Any]:
    """What a constraint sees: every resolved knob (the loss's own defaults too), the
    aliases, M (the run's steps) and the axis points' variables."""
    env = dict(flatten(resolved(cfg)))
    env.update({k: f(cfg) for k, f in ALIASES.items()})
    env["M"] = steps
    for p in combo:
        env.update(dict(p.vars))
    return env


def _check_plans(spec: GridSpec, plans: list, dropped: list[str], too_small: list[str]) -> None:
    """The expansion's errors: a budget under one step, every run dropped, a run name too
    long for a file name, two runs of one config."""
    if too_small:
        b = spec.budget
        raise ConfigError(
            f"grid {spec.name!r}: budget {b.amount:g} {b.unit} is smaller than one step of"
            f" {len(too_small)} run(s): "
            + "; ".join(too_small[:3])
            + f" {b.unit}. Raise the budget or tighten the constraints."
        )
    if not plans:
        n = len(dropped)
        raise ConfigError(
            f"grid {spec.name!r}: no run satisfies the constraints {list(spec.constraints)};"
            f" all {n} combinations were dropped, e.g. " + "; ".join(dropped[:3])
        )
    long = next((p.name for p in plans if len(p.name) > MAX_NAME), None)
    if long:
        raise ConfigError(
            f"grid {spec.name!r}: run name {long[:40]!r}... is {len(long)} characters, over"
            f" the {MAX_NAME} a run directory's and its log's file names take; shorten the"
            " axis point labels (Axis.of's short=, Axis.variants' labels)"
        )
    ids = [p.run_id for p in plans]
    if len(set(ids)) != len(ids):
        dup = sorted({p.group for p in plans if ids.count(p.run_id) > 1})
        raise ConfigError(
            f"grid {spec.name!r}: axis points {dup} resolve to the same config; an axis sets a"
            " knob to the value another point already gives it"
        )
