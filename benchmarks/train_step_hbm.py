"""The train step's HBM per chip on a TPU topology, compiled from this host (libtpu, no TPU).

    python benchmarks/train_step_hbm.py RECIPE --topology v5e:2x2 [key=value ...]

Builds the trainer's update program as `rl-jax plan` does (`make_update` on abstract
arrays with the run's shardings) and compiles only it: one compile instead of a
plan's seven, to compare memory knobs (model.attention, model.remat,
model.logprob_chunk) at one shape. Prints one JSON object: per chip, the compiled
program's arguments, outputs, aliased bytes and temporaries (GB), and the compile time.
"""

from __future__ import annotations

import argparse
import json

from rl_jax.config import load_recipe
from rl_jax.plan._programs import OutOfMemory, _build, _compile, plan_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--topology", default="v5e:2x2")
    args = p.parse_args()
    cfg, _, mesh, spec, rules, tp, tg = plan_target(
        load_recipe(args.recipe, args.overrides), args.topology
    )
    sc, M = cfg.sampling, cfg.train.updates_per_batch
    b = _build(
        cfg,
        spec,
        mesh,
        rules,
        minibatches=M,
        wave_prompts=cfg.data.prompts_per_batch,
        tp=tp,
        tg=tg,
    )
    out = {
        "topology": args.topology,
        "overrides": args.overrides,
        "rows_per_update": cfg.data.prompts_per_batch // M * sc.n,
        "tokens_per_row": tp + tg,
    }
    done = _compile(b.update, *b.update_args)
    if isinstance(done, OutOfMemory):
        out["out_of_memory"] = done.message
        out["required_gb"] = done.required_bytes / 1e9
    else:
        compiled, seconds = done
        m = compiled.memory_analysis()
        gb = 1e9
        out.update(
            arguments_gb=m.argument_size_in_bytes / gb,
            outputs_gb=m.output_size_in_bytes / gb,
            aliased_gb=m.alias_size_in_bytes / gb,
            temporaries_gb=m.temp_size_in_bytes / gb,
            compile_s=round(seconds, 1),
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
