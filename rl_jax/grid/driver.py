"""The grid driver: launch runs on a backend, resume, retry, stop early.

Invariants (they are what makes a killed driver safe to rerun):
- a run is finished iff `<run>/DONE` exists; finished runs are never launched;
- every attempt runs under the guard, which holds the run's lock while its
  processes live: a restarted driver adopts runs still going from a killed
  driver (waits on their lock) instead of starting them again;
- the state file counts launches and failures per run id, written atomically
  before each launch, so the retry limit survives restarts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from rl_jax.grid._guard import BUSY, holder, is_locked, read_attempt
from rl_jax.grid.backends import Backend, guard_argv
from rl_jax.grid.expand import RunPlan
from rl_jax.grid.spec import GridSpec
from rl_jax.grid.state import GridState, driver_lock
from rl_jax.runs.run_dir import find_run_dirs
from rl_jax.runs.storage import is_remote, join, open_store

PLAN_FILE = "plan.json"
# Exit statuses of `rl-jax train` that the same command repeats, so the driver does not
# retry them: 2, a config error; 3, a run that failed where its resume replays it exactly
# (NaN/Inf updates, every training problem retired by No-Positive-Resampling).
CONFIG_ERROR = 2
RUN_ERROR = 3


def grid_dir(spec: GridSpec, out: str | Path) -> str:
    """OUT/<grid>: a local path (made absolute) or a bucket URL."""
    if is_remote(out):
        return join(out, spec.name)
    return str(Path(out).resolve() / spec.name)


def run_dir(runs: str, plan: RunPlan) -> str:
    """The run directory of `plan` under the grid's runs root (Backend.runs_root)."""
    return join(runs, plan.name)


def find_runs(plans: Sequence[RunPlan], runs: str, log: Callable[[str], None]) -> list[RunPlan]:
    """`plans`, each named for the directory under `runs` that holds its run: its own name,
    or that of a run directory the grid made under an earlier run-id version, which holds
    the same run (`rl_jax.runs.run_dir.find_run_dirs`; the trainer takes it up). Said in
    one line when there are any."""
    found = find_run_dirs(runs, [(p.name, p.run_id) for p in plans])
    if found:
        new, old = next(iter(found.items()))
        log(
            f"{len(found)} run(s) found in directories named for their run ids of an earlier "
            f"id version, e.g. {old} for {new}; they resume there"
        )
    return [dataclasses.replace(p, name=found[p.name]) if p.name in found else p for p in plans]


def is_done(runs: str, plan: RunPlan) -> bool:
    return open_store(run_dir(runs, plan)).exists("DONE")


def run_status(st: GridState, runs: str, plan: RunPlan) -> str:
    """'done' (its DONE file), else the state file's status; 'new' for a run never launched."""
    rec = st.runs.get(plan.run_id)
    return "done" if is_done(runs, plan) else (rec.status if rec else "new")


def plan_rows(plans: Sequence[RunPlan]) -> list[dict[str, Any]]:
    """The plan as JSON rows (plan.json, --dry-run --json)."""
    return [
        {
            "name": p.name,
            "run_id": p.run_id,
            "group": p.group,
            "labels": dict(p.labels),
            "seed": p.seed,
            "steps": p.steps,
            "step_compute": p.step_compute,
            "compute": p.compute,
            "overrides": list(p.overrides),
        }
        for p in plans
    ]


def _fmt(x: float) -> str:
    if x != x:  # nan
        return "n/a"
    return f"{x:.3g}" if x < 1e5 else f"{x:.2e}"


def print_plan(spec: GridSpec, plans: list[RunPlan], root: str, runs: str, out=sys.stdout) -> None:
    """The plan as a table with each run's compute and status (`rl-jax grid --dry-run`)."""
    st = GridState.load(root, spec.name, plans)
    unit = spec.budget.unit if spec.budget else "rollouts"
    print(f"grid {spec.name}: {len(plans)} runs of recipe {spec.recipe!r} -> {root}", file=out)
    if spec.budget:
        print(
            f"budget: {spec.budget.amount:g} {unit} per run (train.steps = budget / one step)",
            file=out,
        )
    hdr = f"{'#':>3}  {'run':<44} {'B_p':>5} {'n':>5} {'M':>6} {'rollouts':>9}"
    hdr += f" {'gen_tokens':>10} {'flops':>9}  status"
    print(hdr, file=out)
    for p in plans:
        c = p.compute
        status = run_status(st, runs, p)
        print(
            f"{p.index:>3}  {p.name:<44} {p.config.data.prompts_per_batch:>5}"
            f" {p.config.sampling.n:>5} {p.steps:>6} {_fmt(c['rollouts']):>9}"
            f" {_fmt(c['generated_tokens']):>10} {_fmt(c['flops']):>9}  {status}",
            file=out,
        )
    tot = {k: sum(p.compute[k] for p in plans) for k in ("rollouts", "generated_tokens", "flops")}
    print(
        f"total: {_fmt(tot['rollouts'])} rollouts, {_fmt(tot['generated_tokens'])} generated"
        f" tokens (upper bound unless the budget gives mean lengths), {_fmt(tot['flops'])} FLOPs",
        file=out,
    )


@dataclass
class Active:
    plan: RunPlan
    attempt: int
    handle: Any  # None: adopted from an earlier driver, followed through the run lock
    stopping: str = ""  # set when the driver stops it: 'interrupt' or 'early_stop'
    info: dict[str, Any] = field(default_factory=dict)


# Early stopping: given the grid's curve rows per run and the runs still going,
# return {run_id: reason dict} for runs to stop now.
EarlyStopFn = Callable[[dict[str, list[dict[str, Any]]], Sequence[RunPlan]], dict[str, dict]]


@dataclass(eq=False)
class Driver:
    """Runs a grid's plans on a backend until each is done, failed or stopped (`run`)."""

    spec: GridSpec
    plans: Sequence[RunPlan]
    backend: Backend
    _: KW_ONLY
    root: str
    recipe: str
    retry_failed: bool = False
    resume_stopped: bool = False
    poll_s: float = 0.5
    grace_s: float = 30.0
    early_stop: EarlyStopFn | None = None
    early_stop_every_s: float = 30.0
    log: Callable[[str], None] = print

    def __post_init__(self):
        self.plans = list(self.plans)
        self.root = str(self.root)
        self.runs = self.backend.runs_root(self.root)
        self._interrupted = 0

    # -- helpers ------------------------------------------------------------------------

    def _say(self, msg: str) -> None:
        self.log(f"[grid {self.spec.name}] {msg}")

    def _finish(self, st: GridState, a: Active, rc: int | None, queue: list[RunPlan]) -> None:
        p = a.plan
        rec = st.record(p.run_id, p.name)
        self._upload_log(p, a.attempt)
        done = is_done(self.runs, p)
        log = self._log_url(p, a.attempt)
        rec.history.append(
            {"attempt": a.attempt, "rc": rc, "end": time.time(), "stopping": a.stopping or None}
        )
        if done:
            rec.status = "done"
            self._say(f"done     {p.name}")
            self._check_run_id(p)
        elif a.stopping == "early_stop":
            rec.status = "stopped"
            rec.stopped = a.info
            self._say(f"stopped  {p.name} early: {a.info.get('reason', '')}")
        elif a.stopping == "interrupt":
            rec.status = "pending"
        elif rc in (CONFIG_ERROR, RUN_ERROR):
            rec.failures += 1
            rec.status = "failed"
            what = "config error" if rc == CONFIG_ERROR else "the run fails where it resumes"
            self._say(f"FAILED   {p.name}: {what} (exit {rc}), retrying cannot help; log: {log}")
        else:
            rec.failures += 1
            if rec.failures >= self.spec.max_attempts:
                rec.status = "failed"
                self._say(
                    f"FAILED   {p.name} (exit {rc}); gave up after {rec.failures} failures;"
                    f" log: {log}"
                )
            else:
                rec.status = "pending"
                queue.append(p)
                retries = f"{rec.failures}/{self.spec.max_attempts - 1}"
                self._say(f"failed   {p.name} (exit {rc}), retry {retries}; log: {log}")

    def _check_run_id(self, p: RunPlan) -> None:
        """The trainer resolves the same overrides itself; a different id means the grid's
        expansion and the trainer disagree about the config, and the report would mislabel."""
        try:
            rid = json.loads(open_store(run_dir(self.runs, p)).read_bytes("config.json"))
        except (FileNotFoundError, ValueError):
            return
        rid = rid.get("run_id") if isinstance(rid, dict) else None
        if rid not in (None, p.run_id):
            self._say(
                f"WARNING  {p.name}: the trainer's run id is {rid}, the grid's {p.run_id};"
                " the grid's config expansion disagrees with the trainer's (a bug: report it)"
            )

    def _log_path(self, p: RunPlan, attempt: int) -> Path:
        """Where an attempt's output is written: the grid's logs/, or for a grid in a
        bucket a local staging copy that `_upload_log` puts in the bucket's logs/."""
        name = f"{p.name}.{attempt}.log"
        if not is_remote(self.root):
            return Path(self.root) / "logs" / name
        from rl_jax.runtime import user_cache_dir

        key = hashlib.sha256(self.root.encode()).hexdigest()[:16]
        return Path(user_cache_dir("grid-logs")) / key / name

    def _upload_log(self, p: RunPlan, attempt: int) -> None:
        local = self._log_path(p, attempt)
        if is_remote(self.root) and local.exists():
            open_store(self.root).write(f"logs/{local.name}", local.read_bytes())

    def _log_url(self, p: RunPlan, attempt: int) -> str:
        return join(self.root, "logs", f"{p.name}.{attempt}.log")  # a path for a local grid

    def _poll(self, a: Active) -> tuple[bool, int | None]:
        if a.handle is None:
            if is_locked(run_dir(self.runs, a.plan)):
                return False, None
            record = read_attempt(run_dir(self.runs, a.plan), a.attempt)
            return True, None if record is None else record.get("rc")
        rc = self.backend.poll(a.handle)
        return rc is not None, rc

    def _on_signal(self, signum, _frame) -> None:
        self._interrupted = signum

    # -- the loop -----------------------------------------------------------------------

    def run(self) -> dict[str, int]:
        lock = driver_lock(self.root)  # a second driver: LockBusy, exit 2 naming this one
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            lock.release()

    def _run(self) -> dict[str, int]:
        st = GridState.load(self.root, self.spec.name, self.plans)
        open_store(self.root).write_json(
            PLAN_FILE, {"grid": self.spec.name, "runs": plan_rows(self.plans)}
        )
        queue, active = self._triage(st)
        n_done = sum(r.status == "done" for r in st.runs.values())
        self._say(
            f"{len(self.plans)} runs: {n_done} done, {len(active)} running, {len(queue)} to run"
            f" on {self.backend.name}"
        )
        last_check = time.time()
        while queue or active:
            if self._interrupted:
                self._interrupt(st, active)
                raise KeyboardInterrupt
            self._reap(st, active, queue)
            self._launch(st, active, queue)
            if self.early_stop is not None and time.time() - last_check >= self.early_stop_every_s:
                last_check = time.time()
                self._check_early_stop(st, active)
            time.sleep(self.poll_s)
        st.save()
        counts: dict[str, int] = {}
        for p in self.plans:
            s = st.runs[p.run_id].status
            counts[s] = counts.get(s, 0) + 1
        self._say("finished: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        return counts

    def _triage(self, st: GridState) -> tuple[list[RunPlan], list[Active]]:
        """Each run's status at start: done, left stopped or failed, followed (still
        running under a driver that was killed) or queued; (queue, followed)."""
        queue: list[RunPlan] = []
        active: list[Active] = []
        for p in self.plans:
            rec = st.record(p.run_id, p.name)
            if is_done(self.runs, p):
                rec.status = "done"
            elif rec.status == "stopped" and not self.resume_stopped:
                pass
            elif is_locked(run_dir(self.runs, p)):
                # Still running under a driver that was killed: follow it, do not restart.
                rec.status = "running"
                active.append(Active(plan=p, attempt=rec.launches, handle=None))
                self._say(f"adopted  {p.name} (attempt {rec.launches}, still running)")
            elif rec.status == "failed" and not self.retry_failed:
                pass
            else:
                if rec.status == "failed":
                    rec.failures = 0
                rec.status = "pending"
                queue.append(p)
        st.save()
        return queue, active

    def _reap(self, st: GridState, active: list[Active], queue: list[RunPlan]) -> None:
        """Record the runs of `active` that ended (a retry goes back on `queue`)."""
        for a in list(active):
            finished, rc = self._poll(a)
            if not finished:
                continue
            active.remove(a)
            if rc == BUSY and not is_done(self.runs, a.plan):
                # Someone else holds the run: follow it rather than count a failure.
                active.append(Active(plan=a.plan, attempt=a.attempt, handle=None))
                continue
            self._finish(st, a, rc, queue)
            st.save()

    def _launch(self, st: GridState, active: list[Active], queue: list[RunPlan]) -> None:
        """Start the queued runs the backend has room for."""
        for p in list(queue):
            if not self.backend.can_start(p, [a.plan for a in active]):
                continue
            queue.remove(p)
            rec = st.record(p.run_id, p.name)
            if is_done(self.runs, p):
                rec.status = "done"
                st.save()
                continue
            rec.launches += 1
            rec.status = "running"
            st.save()  # before the launch: a crash here costs one attempt, never a rerun
            rd = run_dir(self.runs, p)
            cmd = self.backend.command(p, recipe=self.recipe, grid_dir=self.root)
            handle = self.backend.start(
                p,
                guard_argv(rd, rec.launches, cmd),
                self._log_path(p, rec.launches),
                self._log_url(p, rec.launches) if is_remote(self.root) else None,
            )
            active.append(Active(plan=p, attempt=rec.launches, handle=handle))
            self._say(f"start    {p.name} (attempt {rec.launches})")

    def _check_early_stop(self, st: GridState, active: list[Active]) -> None:
        from rl_jax.runs.atomic import read_jsonl

        running = [a.plan for a in active if not a.stopping]
        try:
            curves = {
                p.run_id: read_jsonl(join(run_dir(self.runs, p), "curve.jsonl")) for p in self.plans
            }
            decisions = self.early_stop(curves, running)
        except Exception as e:  # a damaged curve or a failed fit must not take the grid down
            self._say(f"early-stop check skipped: {type(e).__name__}: {e}")
            return
        for a in active:
            info = decisions.get(a.plan.run_id)
            if info is None or a.stopping:
                continue
            a.stopping, a.info = "early_stop", info
            self._stop(a)

    def _stop(self, a: Active) -> None:
        if a.handle is not None:
            self.backend.stop(a.handle, self.grace_s)
            return
        # Adopted: the lock names the guard (or the trainer) that holds the run.
        h = holder(run_dir(self.runs, a.plan)) or {}
        if h.get("host", socket.gethostname()) != socket.gethostname():
            self._say(f"cannot stop {a.plan.name}: it runs on {h.get('host')} (pid {h.get('pid')})")
            return
        with contextlib.suppress(OSError, ValueError, TypeError):
            os.kill(int(h.get("pid", "")), signal.SIGTERM)

    def _interrupt(self, st: GridState, active: list[Active]) -> None:
        """Stop every run (they resume from their checkpoints next time), then return."""
        self._say(f"signal {self._interrupted}: stopping {len(active)} run(s)")
        for a in active:
            a.stopping = "interrupt"
            self._stop(a)
        deadline = time.time() + self.grace_s + 5
        while active and time.time() < deadline:
            for a in list(active):
                finished, rc = self._poll(a)
                if finished:
                    active.remove(a)
                    self._finish(st, a, rc, [])
            time.sleep(0.1)
        for a in active:
            self._finish(st, a, None, [])
        st.save()
