"""`rl-jax plan --search`: the configurations of a run that change how it runs on a
topology, never what it learns, ranked by the rollouts per hour of those that fit.

Dimensions, each a knob the trainer has:
  mesh          data x fsdp x tensor over the topology's chips (tensor divides the
                heads and is at most 8, the chips one host's interconnect joins)
  remat         model.remat none, save_dots or full: each layer's activations kept,
                only its weight matmuls' outputs kept, or only its input kept
  micro-batches m per optimizer step, any m dividing its prompts
                (train.updates_per_batch = steps x m, train.grad_accum = m: the
                recipe's optimizer steps from programs of more or fewer rows, coarser
                than the recipe's own too), where a micro-batch's rows still split
                over the mesh's batch shards
  waves         PipelineRL only (train.pipeline_waves): W, batches untrained at once
                on the stream (W x B_p groups in flight, W x B_p x n engine slots
                unless sampling.engine_slots); a smaller W bounds staleness tighter.
                The trainer keeps (k + 1) // (optimizer steps per batch) at most,
                micro-batches or not
  slots         the engine's slots (sampling.engine_slots): a slot for every row in
                flight (the default), or a half, a quarter or an eighth of them in
                whole batch shards: a smaller KV cache, more decode steps each
                reading the weights. Only where the trainer samples on the engine and
                the recipe leaves sampling.engine_slots unset
  sampler       PipelineRL only (mesh.sampler_devices): colocated (0), or split mode
                with a quarter or a half of the chips the sampler's and the mesh
                above over the rest; the two sides then run at once, and each
                version's weights are pushed from one to the other

Every candidate is first estimated from formulas (`_estimate`); those whose estimate
exceeds the chip's HBM are dropped without compiling, and the rest are compiled in the
order of their estimated rollouts per hour until `top` of them fit (or all are tried):
a candidate that does not fit costs only its memory compile, one that fits a plan.
`estimate_only` (`--estimate-only`) stops at the estimate: the `top` best candidates
whose estimate fits with the headroom, in seconds. Every row carries the overrides
(`overrides`) that make the recipe that candidate, and the result the shapes every
number is for (`_assumed.shapes`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

from rl_jax.config import RunConfig, apply_overrides, resolved
from rl_jax.knobs import ConfigError
from rl_jax.models.load import resolve_spec
from rl_jax.plan._assumed import planned_model, shapes
from rl_jax.plan._estimate import estimate, sampler_axes
from rl_jax.plan._programs import (
    HEADROOM,
    SCALERL_BUDGET_ROLLOUTS,
    check_prompt_len,
    plan_run,
)
from rl_jax.plan.chips import MAX_TENSOR, num_chips, parse_topology
from rl_jax.train.accounting import batches_in_flight, sampler_rows
from rl_jax.train.parts import check_sizes

REMAT = ("none", "save_dots", "full")
SLOT_SPLITS = (1, 2, 4, 8)
DIMENSIONS = ("mesh", "remat", "micro", "waves", "slots", "sampler")


def candidates(cfg: RunConfig, chips: int, num_heads: int) -> list[dict[str, Any]]:
    """Every combination of the dimensions above that the recipe's batch allows."""
    P, U, A = cfg.data.prompts_per_batch, cfg.train.updates_per_batch, cfg.train.grad_accum
    meshes = [
        ({"data": d, "fsdp": f, "tensor": t}, n)
        for n in _samplers(cfg, chips)
        for t in _divisors(chips - n)
        if t <= MAX_TENSOR and num_heads % t == 0
        for d in _divisors((chips - n) // t)
        for f in [(chips - n) // t // d]
    ]
    steps = U // A  # optimizer steps per batch
    micro = _divisors(P // steps) if U % A == 0 and P % steps == 0 else [A]
    cands = [
        {"mesh": mesh, "remat": remat, "micro": m, "waves": w, "slots": 0, "sampler": n}
        for (mesh, n), remat, m in itertools.product(meshes, REMAT, micro)
        for w in _waves(cfg)
    ]
    return [{**c, "slots": s} for c in cands if _trains(cfg, c) for s in _slots(cfg, c)]


_MICRO_KNOBS = ("updates_per_batch", "grad_accum")


def _micro_knobs(cfg: RunConfig, m: int) -> tuple[int, int]:
    """(train.updates_per_batch, train.grad_accum) of m micro-batches per optimizer step,
    as many optimizer steps per batch as the recipe's; a recipe whose accumulation spans
    batches (grad_accum not dividing its minibatches) keeps its own."""
    U, A = cfg.train.updates_per_batch, cfg.train.grad_accum
    return (U // A * m, m) if U % A == 0 else (U, A)


def _samplers(cfg: RunConfig, chips: int) -> list[int]:
    """Split mode's choices of sampler chips: none (colocated), and for PipelineRL a
    quarter and a half of the chips."""
    if cfg.train.off_policy != "pipeline":
        return [0]
    return [0] + sorted({chips // d for d in (4, 2) if chips % d == 0})


def _trains(cfg: RunConfig, cand: dict[str, Any]) -> bool:
    """Whether the trainer takes a candidate's batch: each (micro-)batch's rows split
    over its batch shards (`check_sizes`, as the trainer checks them)."""
    try:
        check_sizes(apply(cfg, cand), cand["mesh"]["data"] * cand["mesh"]["fsdp"])
    except ConfigError:
        return False
    return True


def _slots(cfg: RunConfig, cand: dict[str, Any]) -> list[int]:
    """The engine's slot counts to try for a candidate: 0 (a slot for every row the
    schedule keeps in flight) and that many rows split 2, 4 or 8 ways where the split
    is a whole number of slots on every batch shard; [0] where there is no choice
    (sampling.engine_slots set by the recipe)."""
    if cfg.sampling.engine_slots:
        return [0]
    rows = sampler_rows(resolved(apply(cfg, cand)))
    shards = cand["mesh"]["data"] * cand["mesh"]["fsdp"]
    if cand["sampler"]:  # the engine's rows split over the sampler's own batch shards
        shards = sampler_axes(cand["mesh"], cand["sampler"])[0]
    return [0] + [rows // s for s in SLOT_SPLITS[1:] if rows % s == 0 and (rows // s) % shards == 0]


def _waves(cfg: RunConfig) -> list[int]:
    """PipelineRL's choices of W (batches untrained at once): the most the trainer keeps
    (`batches_in_flight`, the same with any micro-batches: they split the recipe's optimizer
    steps, not add to them) and halvings of it; [0] (no such knob) otherwise."""
    if cfg.train.off_policy != "pipeline":
        return [0]
    most = batches_in_flight(cfg)
    return sorted({max(1, most >> i) for i in range(4)}, reverse=True)


def _knobs(cfg: RunConfig, cand: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{config section: {field: value}}: the knobs a candidate sets, in the order its
    `overrides` spell them. Micro-batches set two knobs: the optimizer steps x m
    minibatches, m accumulated into each step."""
    mesh = {axis: cand["mesh"][axis] for axis in ("data", "fsdp", "tensor")}
    if cand["sampler"] or cfg.mesh.sampler_devices:
        mesh["sampler_devices"] = cand["sampler"]
    train = dict(zip(_MICRO_KNOBS, _micro_knobs(cfg, cand["micro"]), strict=True))
    if cand["waves"]:
        train["pipeline_waves"] = cand["waves"]
    knobs = {"mesh": mesh, "model": {"remat": cand["remat"]}, "train": train}
    if cand.get("slots", 0):
        knobs["sampling"] = {"engine_slots": cand["slots"]}
    return knobs


def overrides(cfg: RunConfig, cand: dict[str, Any]) -> list[str]:
    """The `key=value` overrides that make `cfg` a candidate's run (`apply` as a command
    line: `rl-jax plan RECIPE <these> --topology T` plans the same run)."""
    return [f"{s}.{k}={v}" for s, knobs in _knobs(cfg, cand).items() for k, v in knobs.items()]


def apply(cfg: RunConfig, cand: dict[str, Any]) -> RunConfig:
    """The run's config with a candidate's knobs set (what `overrides` says, without the
    parsing: the search applies it to every candidate)."""
    sections = _knobs(cfg, cand).items()
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **knobs) for s, knobs in sections}
    )


def _estimated_candidates(cfg: RunConfig, chips: int, chip) -> list[dict[str, Any]]:
    """Every candidate of `cfg` on `chips` chips with its estimate and the overrides that
    make it."""
    spec = resolve_spec(cfg.model)
    cands = candidates(cfg, chips, spec.num_heads)
    for c in cands:
        c_cfg = resolved(apply(cfg, c))
        spec = resolve_spec(c_cfg.model)
        c["estimate"] = estimate(spec, c_cfg, c["mesh"], chip, sampler=c["sampler"])
        c["overrides"] = overrides(cfg, c)
    return cands


def _by_estimate(cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`cands` sorted by estimated rollouts per hour, best first."""
    # Ties (a dimension the roofline does not see) go to the recipe's own choice: the
    # largest PipelineRL W, a slot for every row in flight, then the least memory.
    return sorted(
        cands,
        key=lambda c: (
            -c["estimate"]["rollouts_per_hour"],
            -c["waves"],
            c["slots"] != 0,
            c["sampler"],
            c["estimate"]["hbm_bytes"],
        ),
    )


def search(
    cfg: RunConfig,
    topology: str,
    *,
    top: int = 3,
    headroom: float = HEADROOM,
    budget_rollouts: float = SCALERL_BUDGET_ROLLOUTS,
    plan_fn: Callable[..., dict[str, Any]] = plan_run,
    estimate_only: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Estimate every candidate, then compile down the estimate's ranking until `top`
    candidates fit or every candidate the estimate lets through is tried (`plan_fn` makes
    a candidate's plan, its FLOPs counted only where it fits), and rank those that fit by
    rollouts per hour. `estimate_only`: compile nothing; rank the `top` best estimates
    that fit with `headroom` (seconds instead of plans; the estimate is a first pass).
    `progress`: told of each compile before it starts. Every row carries the `overrides`
    that reproduce it; "shapes" says what every number is for."""
    if top < 1:
        raise ConfigError(f"--top={top}: compile at least one candidate")
    chip, dims = parse_topology(topology)
    chips = num_chips(dims)
    base, source = planned_model(cfg)
    cfg = resolved(base)
    if not estimate_only:
        check_prompt_len(cfg)
    cands = _estimated_candidates(cfg, chips, chip)
    # The compiled plan decides what fits with headroom; the estimate only drops what
    # exceeds the whole chip. Without a compile, the estimate must fit with headroom.
    limit = (1 - headroom) * chip.hbm_bytes if estimate_only else chip.hbm_bytes
    ok = _by_estimate([c for c in cands if c["estimate"]["hbm_bytes"] <= limit])
    excluded = [
        {**_name(c), "reason": "estimate", "hbm_estimate_gb": c["estimate"]["hbm_bytes"] / 1e9}
        for c in cands
        if c["estimate"]["hbm_bytes"] > limit
    ]
    result = {
        "topology": topology,
        "chips": chips,
        "hbm_capacity_gb": chip.hbm_bytes / 1e9,
        "headroom": headroom,
        "fit_limit_gb": (1 - headroom) * chip.hbm_bytes / 1e9,
        "shapes": shapes(cfg, source, budget_rollouts),
        "dimensions": list(DIMENSIONS),
        "candidates": len(cands),
        "passed_estimate": len(ok),
        "top": top,
        "estimate_only": estimate_only,
    }
    if estimate_only:
        ranked, failed = [_estimated(c, budget_rollouts) for c in ok[:top]], []
    else:
        plan = functools.partial(
            plan_fn, topology=topology, headroom=headroom, budget_rollouts=budget_rollouts
        )
        ranked, failed = _compile_until(base, ok, top, plan, progress)
    compiled = 0 if estimate_only else len(ranked) + len(failed)
    return {**result, "compiled": compiled, "excluded": excluded + failed, "ranked": ranked}


def _compile_until(base, ok, top, plan_fn, progress):
    """(rows that fit, ranked; rows that did not, "reason": "compiled"): `ok`'s candidates
    planned in order (from `base` with their overrides, as their command would plan
    them) until `top` fit."""
    ranked, excluded = [], []
    for i, c in enumerate(ok, 1):
        if len(ranked) == top:
            break
        if progress:
            progress(
                f"compiling candidate {i} (of {len(ok)} the estimate lets through;"
                f" {len(ranked)} of {top} found that fit): {' '.join(c['overrides'])}"
            )
        plan = plan_fn(apply_overrides(base, c["overrides"]), flops_if_fits=True)
        row = {
            **_name(c),
            "hbm_estimate_gb": c["estimate"]["hbm_bytes"] / 1e9,
            "hbm_gb": max(p["hbm_total_gb"] for p in plan["programs"]),
            "rollouts_per_hour": plan["step"]["rollouts_per_hour"],
            "mfu_estimate": plan["step"]["mfu_estimate"],
            "budget_hours": plan["budget"]["hours"],
            "plan": plan,
        }
        if plan["fits"]:
            ranked.append(row)
        else:
            excluded.append({**row, "reason": "compiled"})
    ranked.sort(key=lambda r: (-r["rollouts_per_hour"], r["hbm_gb"]))
    return ranked, excluded


def _estimated(c: dict[str, Any], budget_rollouts: float) -> dict[str, Any]:
    """A ranked row from the estimate alone: no "hbm_gb" or "plan" (nothing compiled),
    the estimate's terms per chip instead."""
    e = c["estimate"]
    return {
        **_name(c),
        "hbm_estimate_gb": e["hbm_bytes"] / 1e9,
        "hbm_gb": None,
        "step_s": e["step_s"],
        "rollouts_per_hour": e["rollouts_per_hour"],
        "mfu_estimate": e["mfu_estimate"],
        "budget_hours": budget_rollouts / e["rollouts_per_hour"],
        "estimate_parts_gb": {k: v / 1e9 for k, v in e["parts"].items()},
    }


def _name(c: dict[str, Any]) -> dict[str, Any]:
    return {**{k: c[k] for k in DIMENSIONS}, "overrides": c["overrides"]}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
