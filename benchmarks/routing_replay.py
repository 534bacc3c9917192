"""The sampler/trainer log-prob mismatch of a mixture of experts, with and without routing
replay, beside dense models'; one JSON line.

    python benchmarks/routing_replay.py [--seeds 3] [--experts 8] [--top-k 2] [--dtype bfloat16]
        [--exact-rounding]

The engine samples random prompts (temperature 1, 32 prompts x 4 rows, up to 32 new
tokens) with the model in `--dtype`, recording each token's experts
(`Engine(record_routes=True)`); the trainer then recomputes every kept token's log-prob
with its step's forward (`completion_forward`, compiled with the trainer's options),
once routing each token itself and once replaying the sampler's routes
(`model.routing_replay`); `--exact-rounding`: every model with `model.exact_rounding`.
What is measured is the mismatch |log p_trainer - log p_sampler| per kept token (mean,
99th percentile, max),
and the fraction of (token, layer) routings the two forwards choose differently
("route_flips": the trainer's own top k against the recorded one, over every token the
sampler fed).

Models (random weights, 2 layers, width 64, 4 query / 2 kv heads, vocabulary 64): the
mixture of `--experts` experts of width 48, top `--top-k`; "all_experts": k experts of
width 48, every token through all of them (a mixture with the router's weights and no
routing decision to flip); "split_dense": the dense model's MLP cut into k experts of
width 48 (its gate and up columns, its down rows), every token through all of them at
weight 1 / k (a zero router) and the down rows times k: the dense model's function
through the sparse MLP's dispatch; "one_expert": one expert of width k x 48; "dense": a
dense SwiGLU of width k x 48. All share their attention, norms, embedding and head (the
dense model's), and the one expert is the dense model's MLP: the same function through
the sparse MLP's code. "crossed": the dense model's and split_dense's trainers each
against the other's sampler (which side's sparse MLP adds split_dense's excess). Each
over `--seeds` weight draws; the statistics pool their tokens. (In bfloat16 every
decode step here runs XLA's ops: the CPU decode kernels take float32 only.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import load_avg  # noqa: E402

from rl_jax.config import ModelConfig, SamplingConfig  # noqa: E402
from rl_jax.models import Transformer, init_params, resolve_spec  # noqa: E402
from rl_jax.sampling import Engine  # noqa: E402
from rl_jax.sharding import get_rules  # noqa: E402
from rl_jax.train.step import (  # noqa: E402
    compiler_options,
    completion_forward,
    put_batch,
    rollout_arrays,
)


def models(experts: int, top_k: int, dtype: str) -> dict:
    base = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, compute_dtype=dtype)
    moe = dict(preset="tiny-moe", num_experts_per_tok=top_k, **base)
    return {
        "moe": resolve_spec(ModelConfig(num_experts=experts, moe_intermediate_size=48, **moe)),
        "all_experts": resolve_spec(
            ModelConfig(num_experts=top_k, moe_intermediate_size=48, **moe)
        ),
        "split_dense": resolve_spec(
            ModelConfig(num_experts=top_k, moe_intermediate_size=48, **moe)
        ),
        "one_expert": resolve_spec(
            ModelConfig(
                num_experts=1, moe_intermediate_size=48 * top_k, **{**moe, "num_experts_per_tok": 1}
            )
        ),
        "dense": resolve_spec(
            ModelConfig(num_experts=experts, moe_intermediate_size=48, **moe)
        ).replace(
            num_experts=0,
            num_experts_per_tok=0,
            moe_intermediate_size=0,
            intermediate_size=48 * top_k,
        ),
    }


def trainer_logprobs(spec, params, out, routes) -> np.ndarray:
    """The trainer's log-probs [B, Tg] of the completions, routing as `routes` says (None:
    the router's own top k)."""
    out = dataclasses.replace(out, routes=routes)
    host = rollout_arrays(out, out.completion_mask, np.zeros(out.num_rows))
    fwd = jax.jit(
        lambda p, b: completion_forward(spec, get_rules("fsdp_tp"), None, p, b, 1.0)[0],
        compiler_options=compiler_options(None, spec),  # the trainer's
    )
    return np.asarray(fwd(params, put_batch(host, None)))


def route_flips(spec, params, out) -> tuple[int, int]:
    """(token-layer routings the trainer's forward chooses differently, all of them) over
    the tokens the sampler fed (prompts and completions but their last tokens)."""
    tp, tg = out.prompt_tokens.shape[1], out.completion_tokens.shape[1]
    tokens = np.concatenate([out.prompt_tokens, out.completion_tokens], axis=1)
    valid = np.concatenate([out.prompt_mask, np.arange(tg) < out.lengths[:, None]], axis=1)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    model = jax.jit(
        lambda p, *a: Transformer(spec, p)(a[0], a[2], kv_valid_bs=a[1], record_routes=True),
        compiler_options=compiler_options(None, spec),
    )
    own = np.asarray(model(params, tokens, valid, positions)[2])
    fed = np.concatenate([out.prompt_mask, np.arange(tg) < out.lengths[:, None] - 1], axis=1)
    fed[:, tp - 1] = True
    same = np.all(np.sort(own, -1) == np.sort(out.routes, -1), axis=-1)  # [B, T, L]
    return int((~same)[fed].sum()), int(same[fed].size)


def weights(name: str, specs: dict, seed: int) -> dict:
    """Seed `seed`'s weights of model `name`: the dense model's, and the mixtures with the
    dense model's attention, norms, embedding and head (their MLP their own; the one
    expert's MLP is the dense model's, its router all zeros: probability 1)."""
    dense = init_params(specs["dense"], jax.random.key(seed))
    if name == "dense":
        return dense
    shared = {k: v for k, v in dense.items() if k not in ("gate", "up", "down")}
    L, D = dense["gate"].shape[:2]
    if name == "one_expert":
        mlp = {f"expert_{k}": dense[k][:, None] for k in ("gate", "up", "down")}
        return {**shared, **mlp, "router": np.zeros((L, D, 1), np.float32)}
    if name == "split_dense":  # k experts of 48 columns each, weighted 1 / k
        k = specs[name].num_experts

        def cut(a, axis):
            return np.stack(np.split(np.asarray(a), k, axis=axis), axis=1)

        mlp = {
            "expert_gate": cut(dense["gate"], 2),
            "expert_up": cut(dense["up"], 2),
            "expert_down": cut(dense["down"], 1) * k,
        }
        return {**shared, **mlp, "router": np.zeros((L, D, k), np.float32)}
    own = init_params(specs[name], jax.random.key(seed + 1000))
    return {**shared, **{k: own[k] for k in ("router", "expert_gate", "expert_up", "expert_down")}}


def stats(gaps: list[np.ndarray]) -> dict:
    g = np.concatenate(gaps)
    return {
        "mean": float(g.mean()),
        "p99": float(np.quantile(g, 0.99)),
        "max": float(g.max()),
        "tokens": int(g.size),
    }


def crossed(specs: dict, runs: dict, seeds: int) -> dict:
    """The dense model's trainer against split_dense's sampler and the other way round,
    over the rows both sampled alike (one function: mostly the same tokens): the side
    whose sparse MLP adds the excess shows it in both pairs it is in."""
    gaps: dict[str, list] = {"split_trainer_dense_sampler": [], "dense_trainer_split_sampler": []}
    for seed in range(seeds):
        (pd, od), (ps, osp) = runs["dense", seed], runs["split_dense", seed]
        same = np.all(od.completion_tokens == osp.completion_tokens, axis=1)
        m = od.completion_mask & (same & (od.lengths == osp.lengths))[:, None]
        split_trainer = trainer_logprobs(specs["split_dense"], ps, od, None)
        dense_trainer = trainer_logprobs(specs["dense"], pd, osp, None)
        gaps["split_trainer_dense_sampler"].append(np.abs(split_trainer - od.logprobs)[m])
        gaps["dense_trainer_split_sampler"].append(np.abs(dense_trainer - osp.logprobs)[m])
    return {k: stats(v) for k, v in gaps.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--exact-rounding", action="store_true", help="model.exact_rounding=true")
    args = ap.parse_args()
    load_start = load_avg()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=32, length_bucket=8, max_prompt_len=16)
    gaps: dict[str, list] = {
        k: [] for k in ("moe", "moe_replay", "all_experts", "split_dense", "one_expert", "dense")
    }
    flips, runs = [0, 0], {}
    specs = models(args.experts, args.top_k, args.dtype)
    specs = {k: s.replace(exact_rounding=args.exact_rounding) for k, s in specs.items()}
    for name, spec in specs.items():
        record = name == "moe"
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            prompts = [list(rng.integers(3, 64, rng.integers(4, 16))) for _ in range(32)]
            params = weights(name, specs, seed)
            engine = Engine(spec, cfg, slots=32, chunk=8, pad_id=0, record_routes=record)
            out, _ = engine.run(params, prompts, n=4, seed=seed)
            m = out.completion_mask
            if name in ("dense", "split_dense"):
                runs[name, seed] = params, out
            gaps[name].append(np.abs(trainer_logprobs(spec, params, out, None) - out.logprobs)[m])
            if record:
                replay = trainer_logprobs(spec, params, out, out.routes)
                gaps["moe_replay"].append(np.abs(replay - out.logprobs)[m])
                got = route_flips(spec, params, out)
                flips = [flips[0] + got[0], flips[1] + got[1]]
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "exact_rounding": args.exact_rounding,
                "experts": args.experts,
                "top_k": args.top_k,
                "seeds": args.seeds,
                "gap": {k: stats(v) for k, v in gaps.items()},
                "crossed": crossed(specs, runs, args.seeds),
                "route_flips": flips[0] / max(flips[1], 1),
                "routings": flips[1],
                "load_avg_1m_start": load_start,
                "load_avg_1m_end": load_avg(),
            }
        )
    )


if __name__ == "__main__":
    main()
