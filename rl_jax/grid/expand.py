"""Expand a GridSpec into concrete runs: resolved configs, stable ids, steps from the budget."""

from __future__ import annotations

import ast
import itertools
import json
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rl_jax.config import (
    ConfigError,
    OverrideError,
    RunConfig,
    all_keys,
    apply_overrides,
    flatten,
    load_recipe,
    run_id,
)
from rl_jax.grid.spec import Budget, GridSpec

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

    def train_args(self, recipe_path: str, *, out_dir: str) -> list[str]:
        """Arguments after `rl-jax train`: the recipe, every override, then where to write."""
        return [recipe_path, *self.overrides, f"name={self.name}", f"out_dir={out_dir}"]


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
        # Quoted so that '01' stays a string and ': ' is not YAML syntax.
        text = "'" + value.replace("'", "''") + "'"
    else:
        raise ConfigError(f"{key}={value!r}: cannot pass a {type(value).__name__} as an override")
    return f"{key}={text}"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and float(a) == float(b)
    return a == b


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
        return bool(self._eval(self._tree.body, env))

    def _eval(self, node: ast.AST, env: dict[str, Any]) -> Any:
        name = _dotted(node)
        if name is not None:
            return env[name]
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            return _BIN[type(node.op)](self._eval(node.left, env), self._eval(node.right, env))
        if isinstance(node, ast.UnaryOp):
            v = self._eval(node.operand, env)
            if isinstance(node.op, ast.Not):
                return not v
            if isinstance(node.op, ast.USub):
                return -v
            if isinstance(node.op, ast.UAdd):
                return +v
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


def rollout_flops(cfg: RunConfig, prompt_tokens: float, generated_tokens: float) -> float:
    """Estimated FLOPs of one rollout: sampling it, training on it, a reference pass if KL.

    Uses the model's FLOPs per token (rl_jax.models.spec); nan if that module is
    not available in this build.
    """
    try:
        from rl_jax.models.spec import resolve_spec
    except ImportError:
        return math.nan
    spec = resolve_spec(cfg.model)
    T = int(math.ceil(prompt_tokens + generated_tokens))
    fwd = spec.sequence_flops(T)
    total = fwd + spec.sequence_flops(T, train=True)
    if cfg.loss.kl_coef > 0:
        total += fwd
    return float(total)


def step_compute(cfg: RunConfig, budget: Budget | None = None) -> dict[str, float]:
    """Compute of one RL step in each unit (rollouts exact; tokens and FLOPs estimated)."""
    rollouts = cfg.data.prompts_per_batch * cfg.sampling.n
    p = (budget.prompt_tokens if budget else 0) or cfg.sampling.max_prompt_len
    g = (budget.generated_tokens if budget else 0) or cfg.sampling.max_new_tokens
    return {
        "rollouts": float(rollouts),
        "generated_tokens": float(rollouts * g),
        "flops": rollouts * rollout_flops(cfg, p, g),
    }


# ---- expansion ------------------------------------------------------------------------


def _apply(cfg: RunConfig, overrides: Sequence[str], where: str) -> RunConfig:
    try:
        return apply_overrides(cfg, list(overrides))
    except OverrideError as e:
        raise ConfigError(f"{where}: {e}") from e
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def expand(spec: GridSpec, *, extra: Sequence[str] = ()) -> list[RunPlan]:
    """All runs of `spec`, in a stable order. `extra`: overrides a backend adds to every run.

    Raises ConfigError (exit 2) for unknown keys, constraints no run satisfies,
    and a budget smaller than one step.
    """
    base_cfg = load_recipe(spec.recipe)
    known = set(all_keys())
    constraints = [Constraint(c) for c in spec.constraints]
    var_names = {k for a in spec.axes for p in a.points for k, _ in p.vars}
    for c in constraints:
        c.check_names(known | set(ALIASES) | var_names)
    for k in spec.seed_keys:
        if k not in known:
            raise ConfigError(f"grid {spec.name!r}: seed key {k!r} is not a config key")
    owners: dict[str, str] = {}
    for a in spec.axes:
        for p in a.points:
            for k, _ in p.overrides:
                if owners.setdefault(k, a.name) != a.name:
                    raise ConfigError(
                        f"grid {spec.name!r}: key {k!r} is set by axes {owners[k]!r} and {a.name!r}"
                    )

    base_ov = [format_override(k, v) for k, v in spec.base]
    base_cfg = _apply(base_cfg, base_ov, f"grid {spec.name!r} base")

    plans: list[RunPlan] = []
    dropped: list[str] = []
    too_small: list[str] = []
    for combo in itertools.product(*(a.points for a in spec.axes)):
        pairs = [kv for p in combo for kv in p.overrides]
        labels = tuple((a.name, p.label) for a, p in zip(spec.axes, combo, strict=True))
        group = "_".join(p.label for p in combo) or "base"
        where = f"grid {spec.name!r} run {group}"
        point_ov = [format_override(k, v) for k, v in pairs]
        for seed in spec.seeds:
            seed_ov = [format_override(k, seed) for k in spec.seed_keys]
            cfg = _apply(base_cfg, point_ov + seed_ov + list(extra), where)
            per_step = step_compute(cfg, spec.budget)
            derived = []
            if spec.budget is not None:
                per = per_step[spec.budget.unit]
                if math.isnan(per):
                    raise ConfigError(
                        f"grid {spec.name!r}: budget unit {spec.budget.unit!r} needs the model's"
                        " FLOPs per token (rl_jax.models.spec), not in this build; use rollouts"
                        " or generated_tokens"
                    )
                steps = int(math.floor(spec.budget.amount / per + 1e-9))
                derived.append(f"train.steps={steps}")
            else:
                steps = cfg.train.steps
            if spec.evals_per_run:
                derived.append(f"eval.every={max(1, steps // spec.evals_per_run)}")
            if spec.checkpoints_per_run:
                derived.append(f"checkpoint.every={max(1, steps // spec.checkpoints_per_run)}")
            env = dict(flatten(cfg))
            env.update({k: f(cfg) for k, f in ALIASES.items()})
            env["M"] = steps
            for p in combo:
                env.update(dict(p.vars))
            failed = [c.text for c in constraints if not c(env)]
            if failed:
                dropped.append(f"{group} (fails {failed[0]!r})")
                continue
            if steps < 1:
                too_small.append(f"{group}: one step is {per_step[spec.budget.unit]:g}")
                continue
            cfg = _apply(cfg, derived, where)
            flat = flatten(cfg)
            for k, v in pairs:
                if not _same(flat[k], v):
                    raise ConfigError(f"{where}: {k}={v!r} resolved to {flat[k]!r}; quote it?")
            overrides = tuple(base_ov + point_ov + seed_ov + list(extra) + derived)
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
    ids = [p.run_id for p in plans]
    if len(set(ids)) != len(ids):
        dup = sorted({p.group for p in plans if ids.count(p.run_id) > 1})
        raise ConfigError(
            f"grid {spec.name!r}: axis points {dup} resolve to the same config; an axis sets a"
            " knob to the value another point already gives it"
        )
    return plans
