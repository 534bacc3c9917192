"""The train step's HBM per chip on a TPU topology, compiled from this host (libtpu, no TPU).

    python benchmarks/train_step_hbm.py RECIPE --topology v5e:2x2 [key=value ...]
    python benchmarks/train_step_hbm.py RECIPE --program logprob [key=value ...]

Builds the trainer's update program as `rl-jax plan` does (`make_update` on abstract
arrays with the run's shardings) and compiles only it: one compile instead of a
plan's seven, to compare memory knobs (model.attention, model.remat,
model.logprob_chunk) at one shape. Prints one JSON object: per chip, the compiled
program's arguments, outputs, aliased bytes and temporaries (GB), and the compile time.

`--program logprob` compiles the old/reference log-prob pass instead, twice: over the
update's train.updates_per_batch minibatches one after another, as the trainer runs
it, and over the whole batch at once (the baseline, as it ran before), one JSON
object for each.
"""

from __future__ import annotations

import argparse
import json
import sys

from rl_jax.config import load_recipe
from rl_jax.plan._programs import OutOfMemory, _batch, _build, _compile, plan_target


def _measure(fn, *args) -> dict:
    done = _compile(fn, *args)
    if isinstance(done, OutOfMemory):
        return {"out_of_memory": done.message, "required_gb": done.required_bytes / 1e9}
    compiled, seconds = done
    m = compiled.memory_analysis()
    gb = 1e9
    return dict(
        arguments_gb=m.argument_size_in_bytes / gb,
        outputs_gb=m.output_size_in_bytes / gb,
        aliased_gb=m.alias_size_in_bytes / gb,
        temporaries_gb=m.temp_size_in_bytes / gb,
        compile_s=round(seconds, 1),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--topology", default="v5e:2x2")
    p.add_argument("--program", choices=("train_step", "logprob"), default="train_step")
    args = p.parse_intermixed_args()
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
        batch_prompts=cfg.data.prompts_per_batch,
        tp=tp,
        tg=tg,
    )
    out = {
        "topology": args.topology,
        "overrides": args.overrides,
        "rows_per_update": cfg.data.prompts_per_batch // M * sc.n,
        "tokens_per_row": tp + tg,
    }
    if args.program == "train_step":
        print(json.dumps({**out, **_measure(b.update, *b.update_args)}))
        return
    if b.logprob is None:
        print(
            f"--program logprob: recipe {args.recipe} runs no log-prob pass (it needs"
            " train.updates_per_batch > 1, loss.tis or loss.kl_coef > 0)",
            file=sys.stderr,
        )
        sys.exit(2)
    params, stacked = b.logprob_args
    P, G = cfg.data.prompts_per_batch, sc.n
    whole = _batch(mesh, P, G, tp, tg, old=False, ref=False, critic=False)
    for name, batch in (("minibatches", stacked), ("whole_batch", whole)):
        rows = P * G // (M if name == "minibatches" else 1)
        print(
            json.dumps(
                {
                    **out,
                    "program": f"logprob_{name}",
                    "rows_per_pass": rows,
                    **_measure(b.logprob, params, batch),
                }
            )
        )


if __name__ == "__main__":
    main()
