"""`rl-jax train RECIPE [key=value ...]`: run one recipe into its run directory."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from rl_jax.cli import raw_parser
from rl_jax.config import load_recipe
from rl_jax.config.paths import check_dir_path


def main(argv: list[str]) -> int:
    p = raw_parser(
        "rl-jax train",
        "Run an RL recipe. Rerunning the same command resumes from the newest checkpoint; a"
        " finished run (DONE in its directory) exits at once.",
        knobs=True,
    )
    p.add_argument("recipe", help="recipe file or name in experiments/ (e.g. scalerl)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--run-dir", default=None, help="run directory (default: out_dir/name)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--continue",
        dest="extend",
        action="store_true",
        help="train a finished run further: the same command with a larger train.steps "
        "(a constant learning-rate schedule); its rows become those of the longer run",
    )
    a = p.parse_intermixed_args(argv)
    cfg = load_recipe(a.recipe, a.overrides)
    from rl_jax.runs.run_dir import run_root
    from rl_jax.train.preflight import check_run_inputs

    where = "--run-dir" if a.run_dir is not None else "the run directory (out_dir/name)"
    check_dir_path(run_root(cfg, a.run_dir), where)

    check_run_inputs(cfg)
    if a.extend:
        from rl_jax.runs.run_dir import extend_run

        had = extend_run(cfg, a.run_dir)
        if had < cfg.train.steps:
            print(f"continuing the run of {had} steps to {cfg.train.steps}", file=sys.stderr)
    from rl_jax.train.loop import train

    return run_to_end(lambda: train(cfg, run_root=a.run_dir, quiet=a.quiet), "rl-jax train")


def run_to_end(run: Callable[[], dict], prog: str) -> int:
    """`run()`, a trainer to the end of its run: its summary printed as JSON (exit 0), or
    a failure a rerun repeats said (exit 3: NaN/Inf updates, every problem retired)."""
    from rl_jax.data import DataExhausted
    from rl_jax.train.loop import NonFiniteError

    try:
        summary = run()
    except (NonFiniteError, DataExhausted) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 3
    print(json.dumps(summary, default=str))
    return 0
