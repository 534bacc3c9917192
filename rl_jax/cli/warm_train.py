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
"""

from __future__ import annotations

import argparse
import json
import sys

from rl_jax.config import ConfigError, load_recipe


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_jax.cli.warm_train", description=__doc__)
    p.add_argument("--target", type=float, required=True, help="greedy pass rate to stop at")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    if not 0.0 < a.target < 1.0:
        raise ConfigError(f"--target={a.target} must be in (0, 1)")
    cfg = load_recipe(a.recipe, a.overrides)
    from rl_jax.runtime import setup

    setup()

    from rl_jax.data import DataExhausted
    from rl_jax.train.demo import warm_start
    from rl_jax.train.loop import NonFiniteError, RLTrainer

    trainer = RLTrainer(cfg, quiet=True)
    if trainer.run.read_done() is not None:
        trainer.close()
        return 0
    if not trainer.try_resume():
        info = warm_start(trainer, target=a.target, quiet=True)
        print(f"warm-up: {json.dumps(info, default=str)}", flush=True)
    try:
        summary = trainer.run_loop()
    except (NonFiniteError, DataExhausted) as e:  # a rerun repeats these: exit 3
        print(f"warm_train: {e}", file=sys.stderr)
        return 3
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ConfigError as e:
        print(f"warm_train: config error: {e}", file=sys.stderr)
        sys.exit(2)
