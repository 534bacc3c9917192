"""A run's programs built on abstract arrays, compiled ahead of time for a TPU topology.

Nothing is allocated: parameters, optimizer state and batches are
`jax.ShapeDtypeStruct`s carrying the run's shardings on a mesh of the
topology's devices, and each program is traced, lowered and compiled by XLA
for that target. Per chip, the compiled program's memory (arguments, outputs,
temporaries) and cost (FLOPs, bytes accessed) are facts about the program the
run would execute, not estimates.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rl_jax.config import RunConfig, resolved
from rl_jax.knobs import ConfigError
from rl_jax.models.load import resolve_spec
from rl_jax.models.transformer import param_shardings
from rl_jax.plan.chips import Chip, parse_topology
from rl_jax.sharding import batch_sharding, get_rules, make_mesh
from rl_jax.train.accounting import TRAIN_PASSES, forward_flops
from rl_jax.train.optim import make_optimizer
from rl_jax.train.params import ParamPlan
from rl_jax.train.step import TrainBatch, make_logprob_fn, make_train_step

HEADROOM = 0.10  # a program fits when it leaves this fraction of the chip's HBM free


def topology_devices(topology: str) -> list:
    """The devices of a TPU topology, compiled for from this host (libtpu, no TPU).

    libtpu takes a machine-wide lock file when it loads, for the TPU it would drive;
    a plan drives none, so several planning processes (a test run's workers, a
    search) may load it side by side."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001 - libtpu missing or the name unknown to it
        raise ConfigError(f"--topology={topology!r}: cannot describe it here ({_first(e)})") from e
    return list(desc.devices)


def plan_run(cfg: RunConfig, topology: str, *, headroom: float = HEADROOM) -> dict[str, Any]:
    """Compile the run's training programs for `topology`; the plan as a JSON-able dict."""
    chip, _ = parse_topology(topology)
    cfg = resolved(cfg)
    devices = topology_devices(topology)
    mesh = make_mesh(dataclasses.replace(cfg.mesh, num_devices=0), devices=devices)
    spec = resolve_spec(cfg.model)
    rules = get_rules(cfg.mesh.rules, purpose="train")
    P, G, M = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.train.updates_per_batch
    if P % M:
        raise ConfigError(
            f"data.prompts_per_batch={P} must be divisible by train.updates_per_batch={M}"
        )
    sc = cfg.sampling
    tp, tg = (
        round_up(sc.max_prompt_len, sc.length_bucket),
        round_up(sc.max_new_tokens, sc.length_bucket),
    )

    shardings = param_shardings(spec, mesh, rules)
    # The trainer's state (float32 masters, LoRA adapters: rl_jax.train.params).
    plan = ParamPlan.from_config(cfg, spec)
    params = plan.abstract_state(spec, shardings, mesh)
    tx, _ = make_optimizer(cfg.train, prompts_per_batch=P, samples_per_prompt=G)
    opt = _compiled_outputs(jax.jit(functools.partial(plan.init_optimizer, tx)), mesh, params)

    loss = cfg.loss
    temperature = sc.temperature or 1.0
    needs_old = M > 1 or loss.tis or (loss.kl_coef > 0 and loss.kl_in_reward)
    critic = loss.advantage == "gae"
    programs = []

    step = make_train_step(
        spec,
        rules,
        mesh,
        tx,
        loss,
        num_groups=P // M,
        max_tokens=sc.max_new_tokens,
        temperature=temperature,
        state_shardings=(
            jax.tree.map(lambda a: a.sharding, params),
            jax.tree.map(lambda a: a.sharding, opt),
        ),
        plan=plan,
    )
    mb = _batch(mesh, P // M, G, tp, tg, old=needs_old, ref=loss.kl_coef > 0, critic=critic)
    fwd_mb = forward_flops(spec, [tp] * (P // M), [tg] * (P // M * G), G)
    programs.append(
        _report(
            "train_step",
            step,
            (params, opt, mb),
            TRAIN_PASSES * fwd_mb,
            chip,
            len(devices),
            headroom,
        )
    )
    if needs_old or loss.kl_coef > 0:
        fn = make_logprob_fn(spec, rules, mesh, temperature=temperature, plan=plan)
        full = _batch(mesh, P, G, tp, tg, old=False, ref=False, critic=critic)
        fwd = forward_flops(spec, [tp] * P, [tg] * (P * G), G)
        programs.append(_report("logprob", fn, (params, full), fwd, chip, len(devices), headroom))
    return {
        "topology": topology,
        "chip": chip.name,
        "chips": len(devices),
        "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape), strict=True)),
        "hbm_capacity_gb": chip.hbm_bytes / 1e9,
        "model": {"params": spec.num_params(), "layers": spec.num_layers},
        "batch": {"prompts": P, "samples": G, "updates": M, "prompt_len": tp, "gen_len": tg},
        "programs": programs,
    }


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _abstract(s, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)


def _compiled_outputs(fn, mesh, *args):
    """Abstract outputs of `fn(*args)` with the shardings XLA gives them on the target;
    outputs that depend on no input (a step count) are replicated over the mesh, as the
    trainer places them."""
    compiled = fn.trace(*args).lower().compile()
    shapes = jax.eval_shape(fn, *args)
    rep = NamedSharding(mesh, PartitionSpec())

    def place(s, sh):
        on_mesh = isinstance(sh, NamedSharding) and sh.mesh == mesh
        return _abstract(s, sh if on_mesh else rep)

    return jax.tree.map(place, shapes, compiled.output_shardings)


def _batch(mesh, groups: int, G: int, tp: int, tg: int, *, old: bool, ref: bool, critic: bool):
    rows, T = groups * G, tp + tg

    def arr(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))

    f32 = jnp.float32
    return TrainBatch(
        tokens=arr((rows, T), jnp.int32),
        valid=arr((rows, T), jnp.bool_),
        positions=arr((rows, T), jnp.int32),
        mask=arr((rows, tg), f32),
        sampler_logp=arr((rows, tg), f32),
        advantages=arr((rows, tg) if critic else (rows,), f32),
        group_ids=arr((rows,), jnp.int32),
        old_logp=arr((rows, tg), f32) if old else None,
        ref_logp=arr((rows, tg), f32) if ref else None,
        old_values=arr((rows, tg), f32) if critic else None,
        returns=arr((rows, tg), f32) if critic else None,
        group_size=G,
    )


def _report(name, fn, args, analytic_total: float, chip: Chip, chips: int, headroom: float):
    t0 = time.perf_counter()
    compiled = fn.trace(*args).lower().compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    parts = {
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
    }
    total = parts["arguments"] + parts["outputs"] - parts["aliased"] + parts["temporaries"]
    total += parts["code"]
    flops = float(cost.get("flops", np.nan))
    moved = float(cost.get("bytes accessed", np.nan))
    analytic = analytic_total / chips  # an SPMD program's costs are per chip
    roofline = chip.roofline_s(flops, moved)
    return {
        "name": name,
        "hbm_total_gb": total / 1e9,
        "hbm_gb": {k: v / 1e9 for k, v in parts.items()},
        "fits": total <= (1 - headroom) * chip.hbm_bytes,
        "headroom": 1 - total / chip.hbm_bytes,
        "flops": flops,
        "flops_analytic": analytic,
        "flops_ratio": flops / analytic if analytic else float("nan"),
        "bytes_accessed": moved,
        "roofline_s": roofline,
        "mfu_estimate": analytic / chip.bf16_flops / roofline if roofline > 0 else float("nan"),
        "compile_s": compile_s,
    }


def _first(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
