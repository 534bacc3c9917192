"""`rl-jax samples RUN [--last N]`: the newest logged completions of a run, readable."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl_jax.knobs import ConfigError


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rl-jax samples",
        description="Print a run's logged (prompt, completion, reward, verdict) rows "
        "(<run>/samples.jsonl; logging.samples_every).",
    )
    p.add_argument("run", help="run directory")
    p.add_argument("--last", type=int, default=8, help="rows to print, newest last (0 = all)")
    a = p.parse_args(argv)
    if not Path(a.run).is_dir():
        raise ConfigError(f"run {a.run!r} is not a directory")
    if a.last < 0:
        raise ConfigError(f"--last={a.last} must be >= 0")
    from rl_jax.runs.samples import format_samples

    sys.stdout.write(format_samples(a.run, last=a.last))
    sys.stdout.flush()
    return 0
