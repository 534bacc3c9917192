"""`rl-jax samples RUN [--step N] [--rows K] [--json]`: a run's logged completions."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_jax.knobs import ConfigError


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rl-jax samples",
        description="Print the (prompt, completion, reward, verdict) rows a run logged at one "
        "step (<run>/samples.jsonl, written every logging.samples_every steps).",
    )
    p.add_argument("run", help="run directory")
    p.add_argument("--step", type=int, default=None, help="step to show (default: the newest)")
    p.add_argument("--rows", type=int, default=0, help="rows to show (default 0: all of the step)")
    p.add_argument("--json", action="store_true", help="one JSON object per row instead of text")
    a = p.parse_args(argv)
    if not Path(a.run).is_dir():
        raise ConfigError(f"run {a.run!r} is not a directory")
    if a.rows < 0:
        raise ConfigError(f"--rows={a.rows} must be >= 0 (0 = every row of the step)")
    from rl_jax.runs.samples import format_row, logged_rows

    rows = logged_rows(a.run, step=a.step, rows=a.rows)
    if a.json:
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        text = "\n".join(format_row(r) for r in rows)
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0
