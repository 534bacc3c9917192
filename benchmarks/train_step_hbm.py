"""The train step's HBM per chip on a TPU topology, compiled from this host (libtpu, no TPU).

    python benchmarks/train_step_hbm.py RECIPE --topology v5e:2x2 [--flash both] [key=value ...]
    python benchmarks/train_step_hbm.py RECIPE --program logprob [key=value ...]

Builds the trainer's update program as `rl-jax plan` does (`make_update` on abstract
arrays with the run's shardings) and compiles only it: one compile instead of a
plan's seven, to compare memory knobs (model.attention, model.remat,
model.logprob_chunk) at one shape. Prints one JSON object: per chip, the compiled
program's arguments, outputs, aliased bytes and temporaries (GB), its Mosaic kernels
(`tpu_custom_call`) and the compile time.

--flash: which `flash_attention` the TPU program's blockwise attention takes: the
platform's (`platform`, splash on TPU: `rl_jax.kernels.tpu`), the portable `xla` one,
or `both`, compiled one after the other at the same shapes (then one entry per kernel
under "flash").

`--program logprob` compiles the old/reference log-prob pass instead, twice: over the
update's train.updates_per_batch minibatches one after another, as the trainer runs
it, and over the whole batch at once (the baseline, as it ran before), one entry
each under "logprob".
"""

from __future__ import annotations

import argparse
import json
import sys

from rl_jax import kernels
from rl_jax.config import load_recipe
from rl_jax.kernels import tpu, xla
from rl_jax.plan._programs import OutOfMemory, Target, _compile, plan_target
from rl_jax.train.accounting import passes
from rl_jax.train.step import abstract_batch


def _measure(fn, *args) -> dict:
    """`fn` compiled on `args`: its per-chip memory (GB), Mosaic kernels, compile time."""
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
        custom_calls=compiled.as_text().count("tpu_custom_call"),
        compile_s=round(seconds, 1),
    )


def _program(args, t: Target) -> dict:
    """The chosen program (or both log-prob passes) compiled."""
    cfg, mesh, tp, tg = t.cfg, t.mesh, t.tp, t.tg
    P, G, M = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.train.updates_per_batch
    run = t.programs().step_programs(tp, tg)
    if args.program == "train_step":
        fn, state_and_batch, _ = run["train_step"]
        return _measure(fn, *state_and_batch)
    fn, (params, stacked), _ = run["logprob"]
    whole = abstract_batch(mesh, P, G, tp, tg, old=False, ref=False, critic=False)
    return {
        "logprob": {
            "minibatches": {"rows_per_pass": P * G // M, **_measure(fn, params, stacked)},
            "whole_batch": {"rows_per_pass": P * G, **_measure(fn, params, whole)},
        }
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--topology", default="v5e:2x2")
    p.add_argument("--program", choices=("train_step", "logprob"), default="train_step")
    p.add_argument("--flash", choices=("platform", "xla", "both"), default="platform")
    args = p.parse_intermixed_args()
    t = plan_target(load_recipe(args.recipe, args.overrides), args.topology)
    cfg, mesh, tp, tg = t.cfg, t.mesh, t.tp, t.tg
    sc, M = cfg.sampling, cfg.train.updates_per_batch
    if args.program == "logprob" and "logprob" not in passes(cfg).calls:
        print(
            f"--program logprob: recipe {args.recipe} runs no log-prob pass (it needs"
            " train.updates_per_batch > 1, loss.tis or loss.kl_coef > 0)",
            file=sys.stderr,
        )
        sys.exit(2)
    out = {
        "topology": args.topology,
        "overrides": args.overrides,
        "rows_per_update": cfg.data.prompts_per_batch // M * sc.n,
        "tokens_per_row": tp + tg,
    }
    if args.flash == "platform":
        out.update(_program(args, t))
    else:
        out["flash"] = {}
        own = "splash" if kernels.for_mesh(mesh).flash_attention is tpu.flash_attention else "own"
        for name in (own, "xla") if args.flash == "both" else ("xla",):
            if name == "xla":  # the TPU registry's flash_attention replaced by the reference
                kernels.register("tpu", flash_attention=xla.flash_attention)
            try:
                out["flash"][name] = _program(args, t)
            finally:
                kernels.register("tpu", flash_attention=tpu.flash_attention)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
