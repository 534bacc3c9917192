"""Bytes the trainer holds per precision and with LoRA, against full fine-tuning (JSON).

    python benchmarks/train_memory.py [--preset qwen2.5-1.5b] [--rank 16]

Shapes only (jax.eval_shape): no weight is made, so any preset runs on a laptop.
For each setting: the trained weights and frozen base (`state_bytes`), the
optimizer state of the run's optimizer (AdamW, `opt_bytes`), and the sampler's
copy in model.param_dtype (`view_bytes`, 0 when the sampler runs the state
itself). The baseline is full fine-tuning with float32 masters in the same run.
"""

from __future__ import annotations

import argparse
import json

import jax

from rl_jax.config import ModelConfig, TrainConfig
from rl_jax.models import resolve_spec
from rl_jax.train.optim import make_optimizer
from rl_jax.train.params import ParamFormat, tree_bytes


def measure(plan: ParamFormat, spec, tx) -> dict:
    state = plan.abstract_state(spec)
    opt = jax.eval_shape(lambda s: plan.init_optimizer(tx, s), state)
    view = 0 if plan.identity else tree_bytes(jax.eval_shape(plan.view, state))
    trained, _ = plan.split(state)
    return {
        "state_bytes": tree_bytes(state),
        "trained_params": sum(x.size for x in jax.tree.leaves(trained)),
        "opt_bytes": tree_bytes(opt),
        "view_bytes": view,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    args = p.parse_args()
    spec = resolve_spec(
        ModelConfig(preset=args.preset, param_dtype="bfloat16", compute_dtype="bfloat16")
    )
    tx, _ = make_optimizer(TrainConfig(), prompts_per_batch=1, samples_per_prompt=1)
    targets = tuple(t for t in args.targets.split(",") if t)
    settings = {
        "full_fp32_master": ParamFormat(param_dtype="bfloat16", precision="fp32_master"),
        "full_fp32_moments": ParamFormat(param_dtype="bfloat16", precision="fp32_moments"),
        "full_pure_bf16": ParamFormat(param_dtype="bfloat16", precision="pure"),
        f"lora_r{args.rank}_fp32_master": ParamFormat(
            param_dtype="bfloat16",
            precision="fp32_master",
            lora_rank=args.rank,
            lora_scale=16.0 / args.rank,
            lora_targets=targets,
        ),
    }
    out = {k: measure(v, spec, tx) for k, v in settings.items()}
    base = out["full_fp32_master"]
    for v in out.values():
        v["opt_vs_baseline"] = round(v["opt_bytes"] / base["opt_bytes"], 5)
        v["total_vs_baseline"] = round(
            (v["state_bytes"] + v["opt_bytes"] + v["view_bytes"])
            / (base["state_bytes"] + base["opt_bytes"] + base["view_bytes"]),
            4,
        )
    print(
        json.dumps(
            {
                "preset": args.preset,
                "params": spec.num_params(),
                "baseline": "full_fp32_master",
                **out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
