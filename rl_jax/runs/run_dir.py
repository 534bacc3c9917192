"""Run directories: <out_dir>/<name>/ with config, run id, metrics, curve rows, events, plots,
checkpoints; on a local disk or in a bucket (`out_dir=gs://BUCKET/runs`).

One process writes a run directory at a time: `create_run_dir` takes the run's lock
(rl_jax.runs.locks: an flock on a disk, a renewed lease in a bucket) and holds it until
`RunDir.close()` or the process ends, so a second launch of the same run is refused
instead of interleaving its rows and checkpoints with the first one's.

The JSONL logs (metrics, curve, samples) are the rows of a curve. `rewind(step, counts)`
cuts them back to a checkpoint's step on resume and compares what is left with the row
counts that checkpoint recorded (`row_counts()` at save time), so a log that lost rows
(emptied, deleted, a damaged line before the checkpoint) stops the run with the file and
line instead of finishing with a silent gap. `extend_run` makes a finished run's
directory hold the same run with more steps (`rl-jax train ... --continue`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from rl_jax.config import (
    ID_VERSION,
    RunConfig,
    flatten,
    from_dict,
    id_version,
    rerun_id,
    resolved,
    run_id,
    to_dict,
)
from rl_jax.knobs import ConfigError
from rl_jax.runs import locks
from rl_jax.runs.atomic import jsonl_bytes, jsonl_rows, scan_jsonl
from rl_jax.runs.storage import (
    FLUSH_EVERY_S,
    LocalStore,
    StorageError,
    Store,
    check_out_dir,
    join,
    open_store,
)

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CURVE = "curve.jsonl"
SAMPLES = "samples.jsonl"
LOGS = (METRICS, CURVE, SAMPLES)
EVENTS = "events"
PLOTS = "plots"
CHECKPOINTS = "checkpoints"
DONE = "DONE"
LOCK = ".lock"
CONTINUED = "continued_from"  # config.json: the run ids a continued run had before


class RunDirError(ConfigError):
    """The run directory cannot be used (busy, another run's, not writable): exit 2."""


class RunDir:
    """One run's directory. Paths are relative names; `url(name)` is what to show."""

    def __init__(self, store: Store, run_id: str, lock=None):
        self.store = store
        self.run_id = run_id
        self.lock = lock
        self.former: list[str] = []  # the run's id under an earlier id version (`adopt`)
        self._rows: dict[str, int] = {}  # rows in each log, once rewound
        self._flushed = time.monotonic()
        if store.remote and lock is not None:
            store.before_write = lock.check  # nothing is written once the lock is lost

    @property
    def root(self) -> str:
        return self.store.root

    @property
    def remote(self) -> bool:
        return self.store.remote

    def url(self, name: str = "") -> str:
        return self.store.url(name)

    # Full paths (or URLs) of the run's files, for readers and messages.
    config_path = property(lambda self: self.url(CONFIG))
    metrics_path = property(lambda self: self.url(METRICS))
    curve_path = property(lambda self: self.url(CURVE))
    samples_path = property(lambda self: self.url(SAMPLES))
    events_dir = property(lambda self: self.url(EVENTS))
    plots_dir = property(lambda self: self.url(PLOTS))
    checkpoints_dir = property(lambda self: self.url(CHECKPOINTS))
    done_path = property(lambda self: self.url(DONE))

    def is_done(self) -> bool:
        return self.store.exists(DONE)

    def read_done(self) -> dict[str, Any] | None:
        """The DONE summary; None when there is none or it does not parse (the run is then
        finished again from its last checkpoint, which rewrites it)."""
        try:
            summary = json.loads(self.store.read_bytes(DONE).decode("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            print(
                f"warning: {self.done_path} is damaged ({e}); finishing the run again",
                file=sys.stderr,
                flush=True,
            )
            return None
        return summary if isinstance(summary, dict) else None

    def write_config(self, cfg: RunConfig) -> None:
        self.store.write_json(CONFIG, _config_doc(self.run_id, cfg, self.continued_from()))

    def continued_from(self) -> list[str]:
        """Run ids this run was continued from (`extend_run`): their checkpoints are its."""
        try:
            old = json.loads(self.store.read_bytes(CONFIG))
        except (FileNotFoundError, ValueError):
            return []
        if not isinstance(old, dict) or old.get("run_id") != self.run_id:
            return list(self.former)
        return list(dict.fromkeys([*(str(r) for r in old.get(CONTINUED, [])), *self.former]))

    def check(self) -> None:
        """StorageError if the run's lock was lost (a bucket lease another host took)."""
        if self.lock is not None:
            self.lock.check()

    def close(self) -> None:
        """Upload pending rows and release the run directory's lock (idempotent)."""
        try:
            if self.lock is None or self.lock.lost is None:
                self.store.flush()
        finally:
            if self.lock is not None:
                self.lock.release()

    def mark_done(self, summary: dict[str, Any]) -> None:
        self.flush()
        self.store.write_json(DONE, summary)

    # ---- the logs ------------------------------------------------------------------------

    def _append(self, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.store.append(name, jsonl_bytes(rows))
            self._rows[name] = self._rows.get(name, 0) + len(rows)

    def append_metrics(self, row: dict[str, Any]) -> None:
        self._append(METRICS, [row])

    def append_curve(self, row: dict[str, Any]) -> None:
        self._append(CURVE, [row])

    def append_samples(self, rows: list[dict[str, Any]]) -> None:
        self._append(SAMPLES, rows)

    def flush(self) -> None:
        """Make the appended rows durable (a bucket uploads its files whole)."""
        self.store.flush()
        self._flushed = time.monotonic()

    def maybe_flush(self) -> None:
        """Flush a bucket run's rows if FLUSH_EVERY_S passed since the last flush."""
        if self.store.remote and time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self.flush()

    def _rows_of(self, name: str) -> list[dict[str, Any]]:
        try:
            return jsonl_rows(self.store.read_bytes(name), self.url(name))
        except FileNotFoundError:
            return []

    def curve(self) -> list[dict[str, Any]]:
        return self._rows_of(CURVE)

    def metrics(self) -> list[dict[str, Any]]:
        return self._rows_of(METRICS)

    def row_counts(self) -> dict[str, int]:
        """Rows in each log (what a checkpoint records; known once `rewind` ran)."""
        return {name: self._rows.get(name, 0) for name in LOGS}

    def rewind(self, last: int, expected: dict[str, int] | None = None) -> None:
        """Cut every log back to rows of step <= `last` (-1: empty it).

        A line that is not a JSON row is dropped when it comes after every row kept (a
        killed writer's tail, bytes appended by hand); one among the rows kept cannot be
        rebuilt and is a RunDirError naming the file and the line. `expected` (the row
        counts the restored checkpoint recorded) must then equal the rows kept: fewer
        means rows are lost, a RunDirError naming the file."""
        for name in LOGS:
            try:
                data = self.store.read_bytes(name)
            except FileNotFoundError:
                data = None
            scan = scan_jsonl(data or b"")
            keep = [i for i, r in enumerate(scan.rows) if _step(r) <= last]
            if keep and scan.bad:
                last_kept = scan.lines[keep[-1]]
                inside = [(ln, why) for ln, why in scan.bad if ln < last_kept]
                if inside:
                    ln, why = inside[0]
                    raise RunDirError(
                        f"{self.url(name)}: line {ln} is {why}, among the rows of steps up to "
                        f"the checkpoint of step {last}; they cannot be rebuilt from it. Restore "
                        "the file, or start the run over with checkpoint.resume=false"
                    )
            rows = [scan.rows[i] for i in keep]
            want = None if expected is None else expected.get(name)
            if want is not None and len(rows) != want:
                raise RunDirError(
                    f"{self.url(name)} holds {len(rows)} rows up to step {last}, where the "
                    f"checkpoint of step {last} recorded {want}: rows are "
                    f"{'missing' if len(rows) < want else 'duplicated'}. Restore the file, or "
                    "start the run over with checkpoint.resume=false"
                )
            if data is not None and (len(rows) != len(scan.rows) or scan.bad or scan.torn):
                self.store.write(name, jsonl_bytes(rows))
            self._rows[name] = len(rows)

    def discard(self, stamp: str) -> str:
        """Move the previous run's logs, events and DONE aside (checkpoint.resume=false)
        into `discarded-<stamp>/`; returns that directory's URL."""
        dest = f"discarded-{stamp}"
        for name in (*LOGS, DONE, EVENTS):  # the checkpoints: Checkpointer.discard
            if self.store.exists(name):
                self.store.move(name, f"{dest}/{name}")
        self._rows = dict.fromkeys(LOGS, 0)
        return self.url(dest)


def _config_doc(rid: str, cfg: RunConfig, continued: list) -> dict[str, Any]:
    """config.json of run `rid`; `continued`: the run ids it was continued from, if any."""
    doc = {"run_id": rid, "config": to_dict(cfg), "knobs": flatten(cfg)}
    return {**doc, CONTINUED: continued} if continued else doc


def _step(row: dict[str, Any]) -> int:
    s = row.get("step", -1)
    return s if isinstance(s, int) else -1


def run_root(cfg: RunConfig, root: str | Path | None = None) -> str:
    """The run directory of `cfg`: `root`, else <out_dir>/<name>."""
    return str(root) if root is not None else join(cfg.out_dir, cfg.name)


def extend_run(cfg: RunConfig, root: str | Path | None = None) -> int:
    """Make the run directory of `cfg` hold `cfg`'s run, where it holds the same run with
    fewer steps (`rl-jax train ... train.steps=N --continue`); returns the steps it had.

    The two configs must differ in train.steps alone, and the learning-rate schedule must
    not depend on it (a constant schedule after a warm-up given in steps): then training
    on from the run's last checkpoint computes what a run of N steps computes, and its
    rows become that run's (their run id and train.steps rewritten; DONE removed). A
    ConfigError (exit 2) says what stands in the way otherwise."""
    path = run_root(cfg, root)
    store = open_store(path)
    try:
        old_doc = json.loads(store.read_bytes(CONFIG))
        old = from_dict(old_doc["config"])
    except FileNotFoundError:
        raise ConfigError(f"--continue: {path} holds no run to continue") from None
    except IsADirectoryError:
        raise ConfigError(
            f"--continue: {store.url(CONFIG)} is a directory, not a run config"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--continue: {store.url(CONFIG)} is not a run config ({e})") from None
    new_id, had = run_id(cfg), old.train.steps
    old_id = current_id(old_doc)
    if old_id == new_id:
        return had  # continued already (or nothing changed): train on as usual
    _check_continuable(cfg, old, old_id, had, path)
    _rewrite_as_continued(store, path, cfg, old_doc, new_id)
    return had


def _check_continuable(cfg: RunConfig, old: RunConfig, old_id, had: int, path) -> None:
    """ConfigError unless `cfg` is the run `old` (id `old_id`, `had` steps) with more
    steps, on a schedule that does not depend on train.steps."""
    if cfg.train.steps <= had:
        raise ConfigError(
            f"--continue: train.steps={cfg.train.steps} must be more than the run's {had}"
        )
    same = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=had))
    if run_id(same) != old_id:
        a, b = flatten(resolved(old)), flatten(resolved(same))
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and "." in k)
        gone = "knobs of an earlier id version that today's code does not run as they ran"
        raise ConfigError(
            f"--continue: the run in {path} differs from this config in more than "
            f"train.steps: {', '.join(diff) or ('its run id' if old_id else gone)}; "
            "continue it with its own knobs"
        )
    r_old, r_new = resolved(old).train, resolved(cfg).train
    if r_new.schedule == "constant" and r_old.warmup_steps != r_new.warmup_steps:
        raise ConfigError(
            f"--continue: the run warmed up for {r_old.warmup_steps:g} steps, this config "
            f"for {r_new.warmup_steps:g} (train.warmup_steps as a fraction of train.steps); "
            f"set train.warmup_steps={r_old.warmup_steps:g}"
        )
    if r_new.schedule != "constant":
        raise ConfigError(
            f"--continue: train.schedule={r_new.schedule!r} with warm-up {r_new.warmup_steps} "
            f"steps spans train.steps, so {had} more steps would not train as a run planned "
            f"for {cfg.train.steps} does; continue runs with train.schedule=constant and "
            "train.warmup_steps given in steps, or start a new run"
        )


def _rewrite_as_continued(store, path, cfg: RunConfig, old_doc: dict, new_id: str) -> None:
    """The run's rows, config.json and DONE as those of `cfg`'s run (under its lock)."""
    lock = locks.acquire(path, LOCK, what=f"run directory {path}")
    try:
        # The knobs as the trainer writes them into its rows.
        _retag_rows(store, old_doc.get("run_id"), new_id, flatten(resolved(cfg)))
        continued = [*old_doc.get(CONTINUED, []), old_doc.get("run_id")]
        store.write_json(CONFIG, _config_doc(new_id, cfg, continued))
        store.remove(DONE)
    finally:
        lock.release()


def current_id(doc: Any) -> str | None:
    """The run id, under today's id version, of the run a config.json (`doc`) describes: its
    own, or for one written under an earlier version the id today's code gives its config
    where it runs that config as it ran (`rl_jax.config.rerun_id`); None otherwise."""
    if not isinstance(doc, dict):
        return None
    rid = doc.get("run_id")
    if id_version(rid) == ID_VERSION:
        return rid
    return rerun_id(doc.get("config"))


def adopt(rd: RunDir, doc: dict[str, Any], *, write: bool) -> None:
    """Take up the run that `rd` holds under its id of an earlier id version (config.json
    `doc`), whose id is `rd.run_id` today: its checkpoints are accepted as this run's,
    and (`write`: the process that holds the lock) its rows, DONE file and config.json
    carry the id from now on, as those of a run started today would. Said on stderr."""
    old_id = str(doc.get("run_id"))
    rd.former = [*rd.former, old_id]
    if not write:
        return
    _retag_rows(rd.store, old_id, rd.run_id)
    done = rd.read_done()
    if done is not None and done.get("run_id") == old_id:
        rd.store.write_json(DONE, {**done, "run_id": rd.run_id})
    rd.store.write_json(
        CONFIG, {**doc, "run_id": rd.run_id, CONTINUED: [*doc.get(CONTINUED, []), old_id]}
    )
    print(
        f"note: {rd.root} holds this run under its run id {old_id} of an earlier id "
        f"version; it is now {rd.run_id} (rows, DONE and config.json rewritten)",
        file=sys.stderr,
        flush=True,
    )


def find_run_dirs(parent: str | Path, runs: list[tuple[str, str]]) -> dict[str, str]:
    """Run directory names under `parent` that end in their run id (`<prefix><id>`: a grid's
    runs, the demo's), given as (name, id): {name: the directory that holds its run} for
    those that do not exist where a sibling `<prefix><earlier id>` named for an id of an
    earlier id version holds their run (`current_id` of its config.json is this id).

    One listing of `parent`; only the config.json of such siblings is read."""
    store = open_store(parent)
    present = store.list()
    found: dict[str, str] = {}
    for name, rid in runs:
        if name in present or not name.endswith(rid):
            continue
        prefix = name[: -len(rid)]
        for other in present:
            if not other.startswith(prefix):
                continue
            version = id_version(other[len(prefix) :])
            if version is None or version >= ID_VERSION:
                continue
            try:
                doc = json.loads(store.read_bytes(f"{other}/{CONFIG}").decode("utf-8"))
            except (FileNotFoundError, ValueError):
                continue
            if current_id(doc) == rid:
                found[name] = other
                break
    return found


def _retag_rows(store: Store, old_id, new_id: str, knobs: dict[str, Any] | None = None) -> None:
    """Each log's rows as rows of run `new_id`: those of run `old_id` take its id, and the
    knobs a curve row carries take their values in `knobs` (a continued run's)."""
    knobs = knobs or {}
    for name in LOGS:
        try:
            scan = scan_jsonl(store.read_bytes(name))
        except FileNotFoundError:
            continue
        rows = []
        for row in scan.rows:
            row = {**row, **{k: v for k, v in knobs.items() if k in row}}
            if row.get("run_id") == old_id:
                row["run_id"] = new_id
            rows.append(row)
        store.write(name, jsonl_bytes(rows))


def run_exists(path: str | Path) -> bool:
    """Whether a run directory is there (locally the directory; in a bucket its config)."""
    store = open_store(path)
    if isinstance(store, LocalStore):
        return store.path().exists()
    return store.exists(CONFIG)


def create_run_dir(
    cfg: RunConfig, root: str | Path | None = None, *, lock: bool = True, write: bool = True
) -> RunDir:
    """Create (or reopen) the run directory, lock it and write the resolved config.

    Reopening with a different resolved config is refused: it would mix two
    experiments' rows in one curve. A config.json that no longer parses is
    rewritten when the rows and the DONE file in the directory carry this run's id
    (checkpoints are checked against it when they are restored).
    `lock=False` is for the processes of a multi-process run other than the first;
    `write=False` leaves config.json to `RunDir.write_config`, for a caller that
    checks more of the config before the directory records it.
    """
    rid = run_id(cfg)
    path = run_root(cfg, root)
    check_out_dir(path, "out_dir" if root is None else "--run-dir")
    store = open_store(path)
    if isinstance(store, LocalStore):
        try:
            for d in ("", PLOTS, CHECKPOINTS):
                store.mkdir(d)
        except OSError as e:
            raise RunDirError(f"cannot create the run directory {path}: {e.strerror or e}") from e
    try:
        run_lock = locks.acquire(path, LOCK, what=f"run directory {path}") if lock else None
    except locks.LockBusy as e:
        raise RunDirError(str(e)) from None
    except OSError as e:
        raise RunDirError(f"cannot lock the run directory {path}: {e}") from e
    rd = RunDir(store, rid, run_lock)
    try:
        _check_owner(rd, write=lock)
        if write:
            rd.write_config(cfg)
    except BaseException:
        rd.close()
        raise
    return rd


def open_run_dir(path: str | Path) -> RunDir:
    """An existing run directory, for reading (no lock): its run id from config.json."""
    store = open_store(path, key="run directory")
    try:
        rid = json.loads(store.read_bytes(CONFIG)).get("run_id", "")
    except (FileNotFoundError, ValueError, AttributeError):
        rid = ""
    return RunDir(store, rid)


def _check_owner(rd: RunDir, *, write: bool) -> None:
    """Refuse a directory that holds another run (config.json, or else its rows); take up
    one that holds this run under an earlier id version (`adopt`)."""
    try:
        old = json.loads(rd.store.read_bytes(CONFIG).decode("utf-8"))
        found = {old.get("run_id")} if isinstance(old, dict) else {None}
        source = rd.config_path
        if found != {rd.run_id} and current_id(old) == rd.run_id:
            adopt(rd, old, write=write)
            return
    except FileNotFoundError:
        # No config.json (deleted, or not written yet): judge by the rows and DONE file.
        found, source = _row_ids(rd), f"the rows in {rd.root}, which has no {CONFIG}"
    except IsADirectoryError:
        # Unlike a damaged file, it cannot be rewritten in place.
        raise RunDirError(
            f"{rd.config_path} is a directory, not a run config; move it away"
        ) from None
    except StorageError:
        raise
    except (OSError, ValueError) as e:
        # Damaged: judge by the run ids the directory's rows and DONE file carry.
        found, source = _row_ids(rd), f"the rows in {rd.root} ({rd.config_path} is damaged: {e})"
        print(f"warning: {rd.config_path} is damaged; rewriting it", file=sys.stderr, flush=True)
    other = sorted(str(r) for r in found if r != rd.run_id)
    if other:
        raise RunDirError(
            f"{rd.root} holds run {', '.join(other)} with another config (from {source}); "
            f"this config's run id is {rd.run_id}. Use another run name or directory."
        )


def _row_ids(rd: RunDir) -> set:
    """The run ids the curve rows and the DONE file of `rd` carry."""
    found = set()
    with contextlib.suppress(OSError, ValueError):
        found |= {r.get("run_id") for r in rd.curve() if "run_id" in r}
    done = rd.read_done()
    if done and "run_id" in done:
        found.add(done["run_id"])
    return found
