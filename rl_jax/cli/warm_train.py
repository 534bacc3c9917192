"""`python -m rl_jax.cli.warm_train --target P RECIPE [key=value ...]`: `rl-jax train` after
the CPU demo's supervised warm-up.

The tiny CPU model starts from random weights, whose pass rate on arithmetic is
about zero: every group has the same reward and RL has nothing to learn from.
The demo fixes this with a short supervised warm-up that stops at a modest
greedy pass rate (`rl_jax.train.demo.warm_start`, cached per model, data and
seed, so all runs of one split share it). CPU grids (GridSpec.warm_start > 0)
train through this module; it follows the `rl-jax train` contract: a finished
run exits 0 at once, a partial run resumes from its checkpoint (without a
second warm-up), exit 2 on config errors.

`--warm-set KEY=VALUE` runs the warm-up with a knob of how the model computes set
otherwise than the run's (rl_jax.grid.spec.WARM_START_KNOBS), e.g. the float32
warm-up for a bfloat16-compute run: both arms of a precision ablation then start
from the same weights, the warm-up cached under that float32 config's key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from rl_jax.config import ConfigError, RunConfig, load_recipe, resolved


def warm_up_config(recipe: str, overrides: list[str], warm_set: list[str]) -> RunConfig:
    """The config the warm-up runs with: the run's, with `warm_set` (knobs of how the model
    computes only, so that it starts from the run's own initial weights) applied last."""
    from rl_jax.grid.spec import WARM_START_KNOBS

    for kv in warm_set:
        key = kv.split("=", 1)[0]
        if key not in WARM_START_KNOBS:
            raise ConfigError(
                f"--warm-set {kv!r}: key {key!r} is not one of {list(WARM_START_KNOBS)}"
            )
    return resolved(load_recipe(recipe, [*overrides, *warm_set]))


class WarmUpView:
    """The trainer as the warm-up sees it (rl_jax.train.demo.warm_start): `cfg` and the
    model spec of the warm-up's config, everything else (the initial weights, data,
    tokenizer, mesh, set_initial_params) the trainer's own."""

    def __init__(self, trainer, cfg: RunConfig):
        self._trainer = trainer
        self.cfg = cfg
        m = cfg.model
        self.spec = dataclasses.replace(
            trainer.spec, compute_dtype=m.compute_dtype, fp32_lm_head=m.fp32_lm_head
        )

    def __getattr__(self, name):
        return getattr(self._trainer, name)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_jax.cli.warm_train", description=__doc__)
    p.add_argument("--target", type=float, required=True, help="greedy pass rate to stop at")
    p.add_argument(
        "--warm-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a knob the warm-up runs with instead of the run's (model.compute_dtype, "
        "model.fp32_lm_head)",
    )
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    if not 0.0 < a.target < 1.0:
        raise ConfigError(f"--target={a.target} must be in (0, 1)")
    cfg = load_recipe(a.recipe, a.overrides)
    warm_cfg = warm_up_config(a.recipe, a.overrides, a.warm_set) if a.warm_set else None
    from rl_jax.runtime import setup

    setup()

    from rl_jax.cli.train import run_to_end
    from rl_jax.train.demo import warm_start
    from rl_jax.train.loop import RLTrainer

    trainer = RLTrainer(cfg, quiet=True)
    if trainer.run.read_done() is not None:
        trainer.close()
        return 0
    if not trainer.try_resume():
        view = trainer if warm_cfg is None else WarmUpView(trainer, warm_cfg)
        info = warm_start(view, target=a.target, quiet=True)
        print(f"warm-up: {json.dumps(info, default=str)}", flush=True)
    return run_to_end(trainer.run_loop, "warm_train")


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"warm_train: config error: {e}", file=sys.stderr)
        sys.exit(2)
