"""`rl-jax` command line: a thin shell that parses and calls.

One module per subcommand in this package (`rl_jax.cli.train`, `.grid`, `.fit`, ...),
each exposing `main(argv: list[str]) -> int` with its own argparse parser. They are
the only modules that wire subsystems together; the library does the work. Modules
are imported only when their subcommand runs, so `rl-jax --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rl_jax.knobs import ConfigError

# name -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("rl_jax.cli.train", "run an RL recipe: rl-jax train RECIPE [key=value ...]"),
    "demo": ("rl_jax.cli.demo", "the CPU demo: ScaleRL on the tiny model, with a report"),
    "grid": ("rl_jax.cli.grid", "run an experiment grid spec (local, ray, tpu backends)"),
    "fit": ("rl_jax.cli.fit", "fit scaling curves: rl-jax fit CURVES... --out DIR"),
    "allocate": (
        "rl_jax.cli.allocate",
        "the compute-optimal (n, B_p, M) for a budget from a grid's frontier, priced on a TPU",
    ),
    "study": ("rl_jax.cli.study", "a seeded leave-one-out study's report from a grid's curves"),
    "eval": ("rl_jax.cli.eval", "evaluate a run's checkpoint: rl-jax eval RUN [--step N]"),
    "sample": ("rl_jax.cli.sample", "sample completions from a model"),
    "samples": ("rl_jax.cli.samples", "a run's logged completions: rl-jax samples RUN [--step N]"),
    "score": ("rl_jax.cli.score", "per-token log-probs of a text under a model (JSON)"),
    "convert": ("rl_jax.cli.convert", "convert between HF checkpoints and rl_jax"),
    "config": ("rl_jax.cli.config", "print the resolved config of a recipe with overrides"),
    "plan": ("rl_jax.cli.plan", "compile a run's programs for a TPU topology: HBM, FLOPs"),
}

# Commands that run JAX: they get rl_jax.runtime's setup (the CPU backend alone on a host
# without an accelerator, the persistent compilation cache, the heap trim); the others
# stay free of a jax import.
COMPILES = frozenset({"train", "demo", "eval", "sample", "score", "plan", "convert"})


def raw_parser(
    prog: str, description: str | None = None, epilog: str | None = None, *, knobs: bool = False
) -> argparse.ArgumentParser:
    """A subcommand's parser that prints its description and epilog as written (often a
    module docstring split at its first blank line); `knobs`: the epilog lists every knob."""
    if knobs:
        from rl_jax.config import describe_knobs

        epilog = "knobs:\n" + describe_knobs()
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def one_line(e: Exception) -> str:
    """An error's message on one line, whatever it wraps (a YAML or JSON error spans several)."""
    return " ".join(line.strip() for line in str(e).strip().splitlines())


def build_parser() -> argparse.ArgumentParser:
    from rl_jax.config import describe_knobs

    p = argparse.ArgumentParser(
        prog="rl-jax",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="JAX-native RL post-training for LLM scaling experiments.",
        epilog="subcommands:\n"
        + "\n".join(f"  {k:<8} {h}" for k, (_, h) in COMMANDS.items())
        + "\n\nconfig knobs (override any with key=value):\n"
        + describe_knobs(),
    )
    p.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND", help="subcommand")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the subcommand")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from {sorted(COMMANDS)}")
    module_name, _ = COMMANDS[argv[0]]
    if argv[0] in COMPILES:
        from rl_jax.runtime import setup

        setup()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("rl_jax"):
            print(f"rl-jax {argv[0]}: not available in this build ({e.name})", file=sys.stderr)
            return 2
        raise
    from rl_jax.runs.storage import STORAGE_EXIT, StorageError

    try:
        return int(module.main(argv[1:]) or 0)
    except StorageError as e:
        # Storage that stayed unreachable after retries, or a lock another host took: the
        # same command resumes once it is back (a grid retries it), so not exit 2.
        print(f"rl-jax {argv[0]}: storage error: {e}", file=sys.stderr)
        return STORAGE_EXIT
    except ConfigError as e:
        print(f"rl-jax {argv[0]}: config error: {one_line(e)}", file=sys.stderr)
        return 2
