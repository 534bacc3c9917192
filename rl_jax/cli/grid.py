"""`rl-jax grid SPEC [options]`: run (or list, with --dry-run) an experiment grid."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import sys
from pathlib import Path

from rl_jax.config import resolve_recipe_path
from rl_jax.config.paths import check_dir_path
from rl_jax.grid.backends import LocalBackend, RayBackend, TpuBackend, TpuOptions, train_cmd_for
from rl_jax.grid.driver import Driver, find_runs, grid_dir, plan_rows, print_plan
from rl_jax.grid.expand import expand
from rl_jax.grid.spec import EarlyStop, GridSpec, known_specs, load_spec
from rl_jax.knobs import ConfigError
from rl_jax.runs.storage import STORAGE_EXIT, StorageError, check_out_dir, is_remote, join


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rl-jax grid",
        description="Run an experiment grid: a spec file with grid() -> GridSpec.",
        epilog="grid specs in experiments/: " + ", ".join(known_specs()),
    )
    p.add_argument("spec", help="spec file or name in experiments/ (e.g. isocompute_cpu)")
    p.add_argument(
        "--out",
        default="grids",
        help="grids directory or bucket (gs://BUCKET/grids); runs go to OUT/<grid>/runs",
    )
    p.add_argument("--backend", choices=("local", "ray", "tpu"), default="local")
    p.add_argument("--jobs", type=int, default=1, help="local: concurrent runs")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their compute")
    p.add_argument(
        "--json", action="store_true", help="with --dry-run or --replay-early: JSON output"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override applied to every run (changes run ids)",
    )
    p.add_argument(
        "--train-cmd",
        default="",
        help="command that trains one run, given RECIPE key=value... (default: rl-jax train,"
        " or rl_jax.cli.warm_train for specs with warm_start)",
    )
    p.add_argument("--retry-failed", action="store_true", help="retry runs that hit max_attempts")
    p.add_argument(
        "--resume-stopped", action="store_true", help="continue runs stopped early before"
    )
    _add_early_stop_options(p)
    p.add_argument("--no-report", action="store_true", help="skip report.md")
    p.add_argument("--report-only", action="store_true", help="only rebuild report.md")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between polls of the runs")
    p.add_argument("--grace", type=float, default=30.0, help="seconds a stopped run gets to exit")
    _add_backend_options(p)
    return p


def _add_early_stop_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-early-stop", action="store_true", help="ignore the spec's early_stop")
    p.add_argument(
        "--stop-early",
        nargs="?",
        const="",
        default=None,
        metavar="THRESHOLD",
        help="stop runs that cannot reach the frontier (iso-compute grids) or the leader's"
        " asymptote: probability below THRESHOLD (default: the spec's, else 0.05)",
    )
    p.add_argument(
        "--replay-early",
        nargs="?",
        const="",
        default=None,
        metavar="CURVES",
        help="replay the early stop on recorded curves (default OUT/<grid>/curves.jsonl) with"
        " --jobs at a time (0: all at once): compute saved, whether the frontier's pick moves;"
        " runs nothing",
    )


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ray backend")
    g.add_argument("--ray-address", default="", help="'' = local Ray; 'auto' or host:port")
    g.add_argument("--ray-cpus", type=int, default=None, help="CPUs of a local Ray instance")
    t = p.add_argument_group("tpu backend (tpu_setup/)")
    t.add_argument("--tpu-type", default="v5litepod-8", help="accelerator type, e.g. v5p-8")
    t.add_argument("--tpu-zone", default="")
    t.add_argument("--tpu-project", default="")
    t.add_argument("--tpu-slices", type=int, default=1, help="slices the runs are spread over")
    t.add_argument("--tpu-prefix", default="rl-jax")
    t.add_argument("--tpu-queued", action="store_true", help="create through queued resources")
    t.add_argument("--tpu-spot", action="store_true")
    t.add_argument("--tpu-version", default="", help="runtime image ('' = per generation)")
    t.add_argument(
        "--tpu-remote-out",
        default="rl_jax_runs",
        help="where runs write: a path on the TPU hosts (relative to ~), or a bucket "
        "(gs://BUCKET/runs) so that a preempted, recreated slice resumes its runs",
    )
    t.add_argument("--tpu-teardown", action="store_true", help="delete the slices at the end")


def make_backend(a: argparse.Namespace, spec: GridSpec):
    train_cmd = (
        shlex.split(a.train_cmd)
        if a.train_cmd
        else train_cmd_for(spec.warm_start, warm_overrides=spec.warm_start_overrides)
    )
    if a.backend == "local":
        return LocalBackend(jobs=a.jobs, train_cmd=train_cmd)
    if a.backend == "ray":
        if a.dry_run:
            return LocalBackend(jobs=1, train_cmd=train_cmd)  # the plan does not need Ray
        return RayBackend(
            address=a.ray_address,
            resources=spec.resources,
            train_cmd=train_cmd,
            num_cpus=a.ray_cpus,
            grace_s=a.grace,
        )
    # --tpu-X is TpuOptions.X (--tpu-type its accelerator).
    same = ("zone", "project", "slices", "prefix", "queued", "spot", "version", "remote_out")
    opts = TpuOptions(accelerator=a.tpu_type, **{k: getattr(a, f"tpu_{k}") for k in same})
    return TpuBackend(
        grid=spec.name,
        options=opts,
        dry_run=a.dry_run,
        warm_start=spec.warm_start,
        warm_overrides=spec.warm_start_overrides,
    )


def with_early_stop(spec: GridSpec, a: argparse.Namespace) -> GridSpec:
    """The spec with --stop-early's threshold (the spec's early_stop or the defaults)."""
    if a.stop_early is None:
        return spec
    if a.no_early_stop:
        raise ConfigError("--stop-early and --no-early-stop contradict each other; drop one")
    es = spec.early_stop or EarlyStop()
    if a.stop_early:
        try:
            threshold = float(a.stop_early)
        except ValueError:
            raise ConfigError(
                f"--stop-early {a.stop_early!r}: give a probability in (0, 0.5), e.g. 0.05"
            ) from None
        es = dataclasses.replace(es, threshold=threshold)
    return spec.replace(early_stop=es)


def replay(spec: GridSpec, a: argparse.Namespace) -> int:
    """--replay-early: the early stop replayed on a grid's recorded curves."""
    from rl_jax import scaling
    from rl_jax.grid.replay import format_replay, replay_early

    src = a.replay_early or join(grid_dir(spec, a.out), "curves.jsonl")
    try:
        rows = scaling.load_rows(src)
    except scaling.FitError as e:
        raise ConfigError(
            f"--replay-early: {e} (run the grid's report first, or name CURVES)"
        ) from None
    rep = replay_early(spec, rows, jobs=a.jobs)
    if a.json:
        print(json.dumps(rep.to_dict(), indent=2, default=str))
    else:
        print(f"grid {spec.name}: curves {src}")
        print(format_replay(rep, spec.report.x))
    return 0


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    for flag, seconds in (("--poll", a.poll), ("--grace", a.grace)):
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"{flag}={seconds} must be a finite number of seconds >= 0")
    check_out_dir(a.out, "--out")
    check_dir_path(a.out, "--out")
    if a.backend == "tpu":
        check_out_dir(a.tpu_remote_out, "--tpu-remote-out")
    spec = with_early_stop(load_spec(a.spec), a)
    if a.replay_early is not None:
        return replay(spec, a)
    backend = make_backend(a, spec)
    plans = expand(spec, extra=[*backend.extra_overrides(), *a.set])
    backend.check(plans)
    root = grid_dir(spec, a.out)
    runs = backend.runs_root(root)
    plans = find_runs(plans, runs, lambda line: print(f"grid {spec.name}: {line}", file=sys.stderr))
    recipe = str(resolve_recipe_path(spec.recipe).resolve())
    if a.dry_run:
        return _dry_run(a, spec, plans, backend, root, runs, recipe)
    if not is_remote(root):
        Path(root).mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    if not a.report_only:
        counts, code = _drive(a, spec, plans, backend, root, recipe)
        if code is not None:
            return code
    if not a.no_report:
        from rl_jax.grid.results import write_report

        path = write_report(spec, plans, root, runs)
        print(f"report: {path}")
    if counts.get("failed"):
        return 1
    return 0


def _dry_run(a, spec: GridSpec, plans, backend, root, runs, recipe: str) -> int:
    """--dry-run: the runs and their compute (or JSON), each run's backend commands, and the
    teardown's; nothing is run."""
    if a.json:
        doc = {"grid": spec.name, "root": str(root), "runs": plan_rows(plans)}
        print(json.dumps(doc, indent=2, default=str))
    else:
        print_plan(spec, plans, root, runs)
    for p in plans:
        lines = backend.dry_run_lines(p, recipe=recipe, grid_dir=root)
        if lines:
            print(f"\n# run {p.name}", *lines, sep="\n")
    if isinstance(backend, TpuBackend) and a.tpu_teardown:
        from rl_jax.grid.backends import run_script_dry

        print("\n# teardown")
        for t in backend.teardown_argv():
            print(*run_script_dry(t), sep="\n")
    return 0


def _drive(a, spec: GridSpec, plans, backend, root, recipe: str):
    """(the driver's counts by state, None), or ({}, the exit status) where it stopped:
    the grid run by its backend (with its early stop), then the slices torn down if asked."""
    early = None
    if spec.early_stop is not None and not a.no_early_stop:
        from rl_jax.grid.results import early_stopper

        early = early_stopper(spec, plans)
    driver = Driver(
        spec,
        plans,
        backend,
        root=root,
        recipe=recipe,
        retry_failed=a.retry_failed,
        resume_stopped=a.resume_stopped,
        poll_s=a.poll,
        grace_s=a.grace,
        early_stop=early,
        early_stop_every_s=spec.early_stop.every_s if spec.early_stop else 30.0,
    )
    try:
        counts = driver.run()
    except KeyboardInterrupt:
        print(
            f"rl-jax grid: interrupted; rerun the same command to resume ({root})",
            file=sys.stderr,
        )
        return {}, 130
    except StorageError as e:
        print(f"rl-jax grid: storage error: {e}", file=sys.stderr)
        return {}, STORAGE_EXIT
    except RuntimeError as e:
        print(f"rl-jax grid: {e}", file=sys.stderr)
        return {}, 1
    finally:
        backend.close()
    if isinstance(backend, TpuBackend) and a.tpu_teardown:
        import subprocess

        for t in backend.teardown_argv():
            subprocess.run(t, check=False)
    return counts, None
