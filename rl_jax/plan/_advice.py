"""What to change when a planned program does not fit: by how much it is over, per chip,
and the knobs that usually bring it under, with the values to try."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rl_jax.config import RunConfig
from rl_jax.knobs import ConfigError
from rl_jax.models.load import resolve_spec
from rl_jax.plan.chips import MAX_TENSOR
from rl_jax.train.accounting import batches_in_flight
from rl_jax.train.parts import check_sizes

_TRAINER = ("train_step", "logprob", "values")


def advice(cfg: RunConfig, plan: dict[str, Any]) -> list[str]:
    """One line per program of `plan` that does not fit: GB over per chip and what to try.
    `cfg`: the planned run (resolved)."""
    limit, cap = plan["fit_limit_gb"], plan["hbm_capacity_gb"]
    lines = []
    for p in plan["programs"]:
        if p["fits"]:
            continue
        over = p["over_gb"]
        by = (
            f"{over:.2f} GB per chip over ({p['hbm_total_gb']:.2f} GB"
            if math.isfinite(over)
            else "over by an amount XLA did not say (it needs more than the chip has"
        )
        lines.append(
            f"{p['name']}: {by} against the {limit:.2f} GB that fit: {cap:.1f} GB less the"
            f" {plan['headroom']:.0%} headroom); try " + "; ".join(_hints(cfg, plan, p))
        )
    return lines


def _hints(cfg: RunConfig, plan: dict[str, Any], program: dict[str, Any]) -> list[str]:
    """The knobs that shrink `program`, most specific first, ending with a larger slice."""
    hints = []
    shards = plan["mesh"]["data"] * plan["mesh"]["fsdp"]
    if program["name"] in _TRAINER:
        if program["name"] == "train_step" and cfg.model.remat != "full":
            hints.append("model.remat=full (each layer keeps only its input for the backward)")
        hints += _micro_batches(cfg, shards)
    resident = program["hbm_gb"].get("resident", 0.0)
    stream = cfg.train.off_policy == "pipeline"
    sampler = program["name"] not in _TRAINER
    split = plan.get("sampler_mesh")  # the engine's own chips (mesh.sampler_devices)
    if sampler or (stream and resident > 0):
        slots = plan["engine"]["slots"]
        fewer, rows = slots // 2, shards if split is None else split["data"] * split["fsdp"]
        if fewer >= rows and fewer % rows == 0:
            why = "KV cache" if sampler else "stream state beside the update"
            hints.append(f"sampling.engine_slots={fewer} (half the {slots} slots: half the {why})")
        w = batches_in_flight(cfg)
        if stream and w > 1:
            hints.append(f"train.pipeline_waves={w - 1} (fewer batches in flight than {w})")
    if sampler and split is not None:
        n = 2 * cfg.mesh.sampler_devices
        if n < plan["chips"]:
            hints.append(
                f"mesh.sampler_devices={n} (the engine's weights and cache over {n} chips)"
            )
    elif sampler:
        hints += _more_tensor(cfg, plan["mesh"])
    hints.append("a larger slice (--topology)")
    hints.append("or --search, which ranks these knobs by what fits")
    return hints


def _more_tensor(cfg: RunConfig, mesh: dict[str, int]) -> list[str]:
    """Twice the tensor parallelism from the fsdp (else data) axis, where the heads and
    the batch's rows still split: the sampler's weights and KV heads over twice the chips
    (as overrides, none where it does not apply)."""
    t = 2 * mesh["tensor"]
    if t > MAX_TENSOR or resolve_spec(cfg.model).num_heads % t:
        return []
    for axis in ("fsdp", "data"):
        if mesh[axis] % 2 == 0:
            try:
                check_sizes(cfg, mesh["data"] * mesh["fsdp"] // 2)
            except ConfigError:
                return []
            return [
                f"mesh.{axis}={mesh[axis] // 2} mesh.tensor={t} (the sampler's weights and KV"
                f" heads over {t} chips)"
            ]
    return []


def _micro_batches(cfg: RunConfig, shards: int) -> list[str]:
    """The fewest more micro-batches the trainer takes (each minibatch split m ways, the
    rows of a micro-batch still split over the batch shards), as overrides (none where it
    takes no more)."""
    P, G = cfg.data.prompts_per_batch, cfg.sampling.n
    M, ga = cfg.train.updates_per_batch, cfg.train.grad_accum
    for m in range(2, P // M + 1):
        if (P // M) % m:
            continue
        train = dataclasses.replace(cfg.train, updates_per_batch=M * m, grad_accum=ga * m)
        try:
            check_sizes(dataclasses.replace(cfg, train=train), shards)
        except ConfigError:
            continue
        rows = P // (M * m) * G // shards
        return [
            f"train.updates_per_batch={M * m} train.grad_accum={ga * m} ({m} micro-batches a"
            f" minibatch, {rows} rows per chip each; the same optimizer steps)"
        ]
    return []
