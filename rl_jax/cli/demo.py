"""`rl-jax demo`: the ScaleRL recipe on the tiny model and the arithmetic task, on CPU.

1. A short supervised warm-up (cached under .cache/demo) stops at a modest
   greedy pass rate, so that RL has groups with both right and wrong samples.
2. The `scalerl` recipe trains from there, evaluating mean@k on held-out prompts.
3. A report: pass rate before and after RL, the fitted sigmoid (rl_jax.scaling)
   and a PNG of the curve in the run's plots/ directory.
"""

from __future__ import annotations

import time

from rl_jax.cli import raw_parser
from rl_jax.config import load_recipe
from rl_jax.knobs import ConfigError


def main(argv: list[str]) -> int:
    p = raw_parser("rl-jax demo", __doc__)
    p.add_argument("overrides", nargs="*", help="key=value overrides of the scalerl recipe")
    p.add_argument(
        "--warmup-target",
        type=float,
        default=0.45,
        help="greedy pass rate at which the supervised warm-up stops",
    )
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if not 0.0 < a.warmup_target < 1.0:
        raise ConfigError(f"--warmup-target={a.warmup_target} must be in (0, 1)")
    cfg = load_recipe("scalerl", ["name=demo", *a.overrides])

    from rl_jax.train.demo import run_demo, write_report

    t0 = time.perf_counter()
    run = run_demo(cfg, warmup_target=a.warmup_target, quiet=a.quiet)
    report = write_report(run, x="flops", metric="val/pass@1")
    print(report)
    print(f"total time {time.perf_counter() - t0:.0f} s; run directory {run.root}")
    return 0
