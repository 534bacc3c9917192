"""Where a run's processes execute: local processes, a Ray cluster, Cloud TPU slices.

A backend turns "run this command for this run" into a handle it can poll and
stop. Every backend runs the same guard command (`rl_jax.grid._guard`), so the
run lock, the DONE check and the attempt records work the same everywhere.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_jax.config import ConfigError, RunConfig, paths
from rl_jax.grid.expand import RunPlan, format_override
from rl_jax.grid.spec import Resources
from rl_jax.runs.storage import is_remote, join

REPO_ROOT = Path(__file__).resolve().parents[2]
TPU_SETUP = REPO_ROOT / "tpu_setup"
DEFAULT_TRAIN_CMD = (sys.executable, "-m", "rl_jax.cli", "train")


def train_cmd_for(
    warm_start: float,
    python: str = sys.executable,
    *,
    warm_overrides: Sequence[tuple[str, Any]] = (),
) -> list[str]:
    """`rl-jax train`, or the warm-started trainer for specs with warm_start > 0 (its
    warm-up run with `warm_overrides`, GridSpec.warm_start_overrides)."""
    if warm_start > 0:
        warm_set = [a for k, v in warm_overrides for a in ("--warm-set", format_override(k, v))]
        return [python, "-m", "rl_jax.cli.warm_train", "--target", repr(warm_start), *warm_set]
    return [python, "-m", "rl_jax.cli", "train"]


def host_train_cmd(warm_start: float, warm_overrides: Sequence[tuple[str, Any]] = ()) -> list[str]:
    """`train_cmd_for` as typed on a host with rl_jax installed (the TPU hosts' venv, where
    launch.sh puts `python` and `rl-jax` first on PATH; a command printed for a user)."""
    if warm_start > 0:
        return train_cmd_for(warm_start, "python", warm_overrides=warm_overrides)
    return ["rl-jax", "train"]


def guard_argv(run_dir: str, attempt: int, cmd: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rl_jax.grid._guard",
        "--run-dir",
        str(run_dir),
        "--attempt",
        str(attempt),
        "--",
        *cmd,
    ]


def _spawn(argv: list[str], log_path: Path, **popen) -> subprocess.Popen:
    """`argv` in a session of its own (see LocalBackend), its output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **popen,
        )


def _stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the guard (which passes it to the trainer), then SIGKILL the whole group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Backend:
    """Interface (and the shared parts). Subclasses: LocalBackend, RayBackend, TpuBackend."""

    name = "base"

    def __init__(self, *, train_cmd: Sequence[str] = DEFAULT_TRAIN_CMD):
        self.train_cmd = list(train_cmd)

    def extra_overrides(self) -> list[str]:
        """Overrides this backend adds to every run (part of the run id)."""
        return []

    def run_out_dir(self, grid_dir: str) -> str:
        """The trainer's out_dir, as the trainer's host sees it."""
        return join(grid_dir, "runs")

    def runs_root(self, grid_dir: str) -> str:
        """Where the driver reads the runs' directories (DONE, locks, curves)."""
        return self.run_out_dir(grid_dir)

    def command(self, plan: RunPlan, *, recipe: str, grid_dir: str) -> list[str]:
        """The run's command (the guard wraps it)."""
        out_dir = self.run_out_dir(grid_dir)
        return [*self.train_cmd, *plan.train_args(recipe, out_dir=out_dir)]

    def can_start(self, plan: RunPlan, active: Sequence[RunPlan]) -> bool:
        raise NotImplementedError

    def start(
        self, plan: RunPlan, argv: list[str], log_path: Path, log_url: str | None = None
    ) -> Any:
        """Start `argv`, its output to `log_path` (a local file; `log_url`: where a grid in
        a bucket keeps it, for backends whose processes run on other machines)."""
        raise NotImplementedError

    def poll(self, handle: Any) -> int | None:
        raise NotImplementedError

    def stop(self, handle: Any, grace_s: float = 30.0) -> None:
        raise NotImplementedError

    def dry_run_lines(self, plan: RunPlan, *, recipe: str, grid_dir: str) -> list[str]:
        return []

    def check(self, plans: Sequence[RunPlan]) -> None:
        """Refuse, before any run starts, runs this backend cannot give their inputs."""

    def close(self) -> None:
        pass


class LocalBackend(Backend):
    """A pool of `jobs` concurrent processes on this machine, each in its own session.

    Own session: a killed driver leaves its runs going (a restarted driver
    adopts them), and Ctrl-C in the terminal reaches only the driver, which
    stops its runs cleanly.
    """

    name = "local"

    def __init__(self, *, jobs: int = 1, train_cmd: Sequence[str] = DEFAULT_TRAIN_CMD):
        super().__init__(train_cmd=train_cmd)
        if jobs < 1:
            raise ConfigError(f"--jobs={jobs} must be >= 1")
        self.jobs = jobs

    def can_start(self, plan: RunPlan, active: Sequence[RunPlan]) -> bool:
        return len(active) < self.jobs

    def start(
        self, plan: RunPlan, argv: list[str], log_path: Path, log_url: str | None = None
    ) -> subprocess.Popen:
        return _spawn(argv, log_path)

    def poll(self, handle: subprocess.Popen) -> int | None:
        return handle.poll()

    def stop(self, handle: subprocess.Popen, grace_s: float = 30.0) -> None:
        _stop_process_group(handle, grace_s)


# ---- Ray --------------------------------------------------------------------------------


def _ray_task(
    argv: list[str], log_path: str, cwd: str, grace_s: float, log_url: str | None = None
) -> int:
    """Body of one Ray task: run the guard command, pass a cancel on to it as SIGTERM.
    With `log_url` (a grid in a bucket), the log is put there when the command ends: the
    node's disk is not the driver's."""
    proc = _spawn(argv, Path(log_path), cwd=cwd)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # ray.cancel
        _stop_process_group(proc, grace_s)
        raise
    finally:
        if log_url:
            from rl_jax.runs.storage import open_store

            parent, _, name = log_url.rpartition("/")
            open_store(parent).write(name, Path(log_path).read_bytes())


class RayBackend(Backend):
    """Each run one Ray task with the spec's resource requests.

    `address`: '' starts a local Ray instance; 'auto' or 'host:port' joins a
    cluster. Run directories must be on storage every node sees: a bucket
    (`--out gs://BUCKET/grids`; locks are leases there) or a path every node mounts
    (NFS, Filestore, a gcsfuse mount with flock support): the guard's lock and the
    DONE file live there. Ray retries a task whose worker or node died (twice:
    `max_retries`); the driver retries runs that exit non-zero.
    """

    name = "ray"

    def __init__(
        self,
        *,
        address: str = "",
        resources: Resources = Resources(),
        train_cmd: Sequence[str] = DEFAULT_TRAIN_CMD,
        num_cpus: int | None = None,
        grace_s: float = 30.0,
    ):
        super().__init__(train_cmd=train_cmd)
        try:
            import ray
        except ImportError as e:
            raise ConfigError(
                "--backend ray needs Ray: pip install 'rl-jax[ray]' (or pip install ray)"
            ) from e
        self.ray = ray
        self._owns_ray = not ray.is_initialized()  # a Ray this backend starts, it shuts down
        if self._owns_ray:
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address:
                kw["address"] = address
            elif num_cpus is not None:
                kw["num_cpus"] = num_cpus
            ray.init(**kw)
        opts: dict[str, Any] = {
            "num_cpus": resources.cpus,
            "num_gpus": resources.gpus,
            "max_retries": 2,
        }
        if resources.custom:
            opts["resources"] = dict(resources.custom)
        self._remote = ray.remote(_ray_task).options(**opts)
        self.grace_s = grace_s

    def can_start(self, plan: RunPlan, active: Sequence[RunPlan]) -> bool:
        return True  # Ray queues tasks until resources free up

    def start(self, plan: RunPlan, argv: list[str], log_path: Path, log_url: str | None = None):
        return self._remote.remote(argv, str(log_path), os.getcwd(), self.grace_s, log_url)

    def poll(self, handle) -> int | None:
        ready, _ = self.ray.wait([handle], timeout=0)
        if not ready:
            return None
        try:
            return int(self.ray.get(handle))
        except (self.ray.exceptions.RayError, KeyboardInterrupt) as e:
            print(f"[grid] ray task failed: {type(e).__name__}: {e}", file=sys.stderr)
            return -1

    def stop(self, handle, grace_s: float = 30.0) -> None:
        self.ray.cancel(handle)
        deadline = time.time() + grace_s + 5
        while time.time() < deadline and self.poll(handle) is None:
            time.sleep(0.2)

    def close(self) -> None:
        if self._owns_ray:
            self.ray.shutdown()


# ---- Cloud TPU --------------------------------------------------------------------------

# Queued-resource / VM runtime image per TPU generation (accelerator type prefix).
TPU_RUNTIMES = {
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}


@dataclass(frozen=True, kw_only=True)
class TpuOptions:
    accelerator: str = "v5litepod-8"  # v4-8, v5litepod-8 (v5e), v5p-8, v6e-8, ...
    zone: str = ""
    project: str = ""
    slices: int = 1  # TPU VMs (or queued resources) the grid spreads over
    prefix: str = "rl-jax"  # slice names: <prefix>-<grid>-<i>
    queued: bool = False  # create through queued resources (waits for capacity)
    spot: bool = False
    version: str = ""  # runtime image ('' = per generation, TPU_RUNTIMES)
    remote_out: str = "rl_jax_runs"  # out_dir on the hosts (relative to $HOME, or absolute)

    def __post_init__(self):
        gen = self.accelerator.split("-")[0]
        if gen not in TPU_RUNTIMES:
            raise ConfigError(
                f"--tpu-type={self.accelerator!r}: unknown TPU generation {gen!r};"
                f" known: {sorted(TPU_RUNTIMES)} (e.g. v5litepod-8, v5p-8, v6e-8, v4-8)"
            )
        if not self.zone:
            raise ConfigError("--backend tpu needs --tpu-zone (e.g. us-central2-b)")
        if self.slices < 1:
            raise ConfigError(f"--tpu-slices={self.slices} must be >= 1")

    @property
    def runtime(self) -> str:
        return self.version or TPU_RUNTIMES[self.accelerator.split("-")[0]]


def input_paths(cfg: RunConfig) -> list[tuple[str, str]]:
    """(knob, path) of every model, data and split path a run of `cfg` reads; a
    data.source=hf name that is not a local directory is a hub dataset, not a path."""
    d = cfg.data
    data_path = d.path if d.source in ("file", "tfds") else ""
    if d.source == "hf" and (paths.is_url(d.path) or Path(d.path).is_dir()):
        data_path = d.path
    pairs = [
        ("model.path", cfg.model.path),
        ("data.path", data_path),
        ("data.val_path", d.val_path if d.source == "file" else ""),
        ("data.split_file", d.split_file),
    ]
    return [(k, v) for k, v in pairs if v]


class TpuBackend(LocalBackend):
    """Runs each run on all hosts of a TPU slice through `tpu_setup/run.sh`.

    The local process is the script: it creates or reuses the slice, installs
    this checkout on every host and starts the run under jax.distributed on all
    hosts. With a bucket for the runs (`--tpu-remote-out gs://BUCKET/...`), each
    run's whole directory, checkpoints included, lives there: a preempted slice that
    is recreated (or any other slice) resumes it, and the driver reads it there. With
    a path on the hosts, the script copies the run directory back (without the
    checkpoints, which stay on the slice so a relaunch resumes), and a run always goes
    to the same slice (index mod slices). With `dry_run`, the script prints the
    gcloud commands instead of running them.

    Every host reads the run's inputs itself: the command names each model, data
    and split path (the recipe's own included), and each must be a URL every host
    reads (gs://BUCKET/..., tpu_setup/README.md) or an absolute path present on
    every host; a relative path is refused, as each host would resolve it on its
    own disk.
    """

    name = "tpu"

    def __init__(
        self,
        *,
        grid: str,
        options: TpuOptions,
        dry_run: bool = False,
        warm_start: float = 0.0,
        warm_overrides: Sequence[tuple[str, Any]] = (),
    ):
        super().__init__(jobs=options.slices)
        self.remote_train_cmd = host_train_cmd(warm_start, warm_overrides)
        self.grid = grid
        self.opts = options
        self.dry_run = dry_run

    def extra_overrides(self) -> list[str]:
        return ["mesh.distributed=true"]

    def slice_name(self, index: int) -> str:
        """The slice of run `index` (runs go round the slices), named as gcloud allows."""
        name = f"{self.opts.prefix}-{self.grid}-{index % self.opts.slices}"
        return name.lower().replace("_", "-")

    def run_out_dir(self, grid_dir: str) -> str:
        return join(self.opts.remote_out, self.grid, "runs")

    def runs_root(self, grid_dir: str) -> str:
        """A bucket's runs are read where they are; runs on the hosts' disks are read
        from the copies run.sh fetches into the grid directory."""
        if is_remote(self.opts.remote_out):
            return self.run_out_dir(grid_dir)
        return join(grid_dir, "runs")

    def can_start(self, plan: RunPlan, active: Sequence[RunPlan]) -> bool:
        return self.slice_name(plan.index) not in {self.slice_name(p.index) for p in active}

    def input_overrides(self, plan: RunPlan) -> list[str]:
        """`key=value` for each input path of the run that no override names already (the
        recipe's own): the command says everything every host reads."""
        given = {o.split("=", 1)[0].strip() for o in plan.overrides}
        out = []
        for key, value in input_paths(plan.config):
            if not paths.is_url(value) and not Path(value).is_absolute():
                raise ConfigError(
                    f"grid run {plan.group}: {key}={value!r} is a relative path; with --backend"
                    " tpu every host reads its inputs itself, so give a URL all hosts read"
                    f" (e.g. --set {key}=gs://BUCKET/..., tpu_setup/README.md) or an absolute"
                    " path present on every host"
                )
            if key not in given:
                out.append(format_override(key, value))
        return out

    def check(self, plans: Sequence[RunPlan]) -> None:
        for plan in plans:
            self.input_overrides(plan)

    def script_argv(self, script: str, *args: str) -> list[str]:
        """A tpu_setup script's command: the zone and project, `args`, then --queued for
        slices made through queued resources."""
        o = self.opts
        argv = ["bash", str(TPU_SETUP / script), "--zone", o.zone]
        if o.project:
            argv += ["--project", o.project]
        return argv + list(args) + (["--queued"] if o.queued else [])

    def command(self, plan: RunPlan, *, recipe: str, grid_dir: str) -> list[str]:
        o = self.opts
        out_dir = self.run_out_dir(grid_dir)
        # Where run.sh puts what it copies back: the run directory (hosts' disks) or
        # only the hosts' logs (a bucket holds the run directory).
        local_runs = self.local_copies(grid_dir)
        # install.sh puts this checkout in ~/rl_jax on each host and launch.sh runs
        # from ~, so a recipe inside the checkout is named by its path from there.
        rp = Path(recipe)
        if rp.is_absolute() and rp.is_relative_to(REPO_ROOT):
            recipe = str(Path("rl_jax") / rp.relative_to(REPO_ROOT))
        flags = {
            "--name": self.slice_name(plan.index),
            "--type": o.accelerator,
            "--version": o.runtime,
            "--src": str(REPO_ROOT),
            "--remote-out": out_dir,
            "--run-name": plan.name,
            "--local-out": str(local_runs),
        }
        argv = self.script_argv("run.sh", *(x for kv in flags.items() for x in kv))
        if o.spot:
            argv.append("--spot")
        train_args = plan.train_args(recipe, out_dir=out_dir, extra=self.input_overrides(plan))
        return [*argv, "--", *self.remote_train_cmd, *train_args]

    def start(self, plan: RunPlan, argv: list[str], log_path: Path, log_url: str | None = None):
        if self.dry_run:
            raise RuntimeError("the tpu backend in dry-run mode does not start runs")
        return super().start(plan, argv, log_path)

    def local_copies(self, grid_dir: str) -> str:
        if is_remote(grid_dir):
            from rl_jax.runtime import user_cache_dir

            return str(user_cache_dir("grid-logs") / self.grid / "host_logs")
        return join(grid_dir, "host_logs" if is_remote(self.opts.remote_out) else "runs")

    def dry_run_lines(self, plan: RunPlan, *, recipe: str, grid_dir: str) -> list[str]:
        argv = self.command(plan, recipe=recipe, grid_dir=grid_dir)
        return run_script_dry(argv)

    def teardown_argv(self) -> list[list[str]]:
        names = sorted(self.slice_name(i) for i in range(self.opts.slices))
        return [self.script_argv("teardown.sh", "--name", n) for n in names]


def run_script_dry(argv: list[str]) -> list[str]:
    """Run a tpu_setup script with DRY_RUN=1: it prints each gcloud command, runs none."""
    env = {**os.environ, "DRY_RUN": "1"}
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if res.returncode != 0:
        raise RuntimeError(
            f"dry run of {shlex.join(argv[:2])} failed ({res.returncode}): {res.stderr.strip()}"
        )
    return res.stdout.splitlines()
