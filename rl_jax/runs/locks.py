"""Locks that keep one writer per run or grid directory, on a disk or in a bucket.

On a local disk a lock is an flock on a file: the kernel releases it when its process
dies, however it dies. The file records who holds it (host, pid, since when).

In a bucket there is no flock and a VM can vanish with its process. A lock there is
an object created only if absent (generation precondition 0) that holds a lease: the
holder rewrites it every `lease_s / 8` seconds, each time on the condition that the
object is still the generation it wrote last. A second launch reads the object: while
its lease is fresh it is refused, naming the holder; once the lease has gone
`lease_s` without renewal (the holder's VM was deleted, its process killed) it is
taken over, again on a generation precondition, so of two launches racing for it one
wins. A holder that cannot renew for 3/4 of its lease, or finds its object replaced,
has lost the lock: `check()` raises from then on, the run directory refuses writes,
and a process that has not stopped by itself soon after is stopped (exit 74), before
the lease ends and another host may take the run.

Lease times are the holder's wall clock compared with the reader's (Cloud VMs keep
theirs synchronized); $RL_JAX_LEASE_S sets the lease (default 120 s).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from rl_jax.knobs import ConfigError
from rl_jax.runs.storage import STORAGE_EXIT, StorageError, _one_line, is_remote, join, retrying


class LockBusy(ConfigError):
    """Another process holds the lock (exit 2 at the CLI)."""


def lease_s() -> float:
    return float(os.environ.get("RL_JAX_LEASE_S", "120"))


def _holder_text(h: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    parts = [f"host {h.get('host', '?')}", f"pid {h.get('pid', '?')}"]
    if isinstance(h.get("acquired"), (int, float)):
        parts.append(f"started {_ago(now - h['acquired'])} ago")
    if isinstance(h.get("renewed"), (int, float)) and "lease_s" in h:
        parts.append(f"lease renewed {_ago(now - h['renewed'])} ago")
    return ", ".join(parts)


def _ago(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "acquired": time.time()}


class FileLock:
    """An exclusive flock on a local file; released by `release()` or when the process
    ends. `what` names the directory in the refusal ('run directory runs/x')."""

    def __init__(self, path: str | os.PathLike, *, what: str):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LockBusy(f"cannot create the lock {self.path}: {e.strerror or e}") from e
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(os.pread(self.fd, 4096, 0))
            os.close(self.fd)
            self.fd = None
            raise LockBusy(
                f"{what} is in use by another process ({_holder_text(holder)}); wait for it "
                "to finish or stop it"
            ) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, (json.dumps(_me()) + "\n").encode())

    lost = None  # an flock cannot be lost while its process lives

    def check(self) -> None:
        """An flock cannot be lost while its process lives."""

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # no holder named once released
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        self.release()


def _read_holder(data: bytes) -> dict[str, Any]:
    """The holder a lock file or object records ({} when unreadable). Files written
    before locks recorded JSON hold a bare pid."""
    text = data.decode("utf-8", "replace").strip()
    try:
        h = json.loads(text)
    except ValueError:
        return {"pid": text.split()[0]} if text else {}
    if isinstance(h, int):
        return {"pid": h}
    return h if isinstance(h, dict) else {}


def file_lock_holder(path: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds the flock on `path` (None: nobody)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(os.pread(fd, 4096, 0)) or {"pid": "?"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# ---- leases in a bucket -----------------------------------------------------------------


def _split_gs(url: str) -> tuple[str, str]:
    rest = url.split("://", 1)[1]
    bucket, _, name = rest.partition("/")
    return bucket, name


_CLIENT = None


def _client():
    global _CLIENT
    if _CLIENT is None:
        from google.cloud import storage

        _CLIENT = storage.Client()
    return _CLIENT


def _blob(url: str):
    bucket, name = _split_gs(url)
    return _client().bucket(bucket).blob(name)


def _precondition_failed():
    from google.api_core import exceptions

    return exceptions.PreconditionFailed


def _read_lease(url: str) -> tuple[dict[str, Any], int] | None:
    """(holder, generation) of the lock object, None when there is none."""
    bucket, name = _split_gs(url)

    def read():
        blob = _client().bucket(bucket).get_blob(name)
        if blob is None:
            return None
        try:
            data = blob.download_as_bytes(if_generation_match=blob.generation)
        except _precondition_failed():
            return "changed"
        return _read_holder(data), int(blob.generation)

    while True:
        got = retrying(f"reading the lock {url}", read)
        if got != "changed":
            return got


def _expired(holder: dict[str, Any], now: float) -> bool:
    renewed = holder.get("renewed")
    lease = holder.get("lease_s")
    if not isinstance(renewed, (int, float)) or not isinstance(lease, (int, float)):
        return True  # damaged or foreign: nobody can be renewing it
    return now - renewed > lease


def lease_holder(url: str) -> dict[str, Any] | None:
    """The holder of the lease at `url` while its lease is fresh, else None."""
    got = _read_lease(url)
    if got is None or _expired(got[0], time.time()):
        return None
    return got[0]


class LeaseLock:
    """A lease on object `url` (gs://), renewed by a daemon thread while held."""

    def __init__(self, url: str, *, what: str, lease: float | None = None):
        self.url = url
        self.what = what
        self.lease_s = lease_s() if lease is None else lease
        self.holder = {**_me(), "token": uuid.uuid4().hex, "lease_s": self.lease_s}
        self._gen: int | None = None
        self.lost: str | None = None  # why the lock was lost, None while it is held
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._acquire()
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True)
        self._thread.start()

    def _body(self) -> bytes:
        return (json.dumps({**self.holder, "renewed": time.time()}) + "\n").encode()

    def _upload(self, generation: int, *, once: bool = False) -> int:
        """Write the lease if the object is at `generation` (0: absent). `once`: a single
        try with a short timeout (renewals retry themselves, against the lease's clock)."""
        blob = _blob(self.url)
        kw = {"retry": None, "timeout": min(30.0, max(1.0, self.lease_s / 8))} if once else {}
        blob.upload_from_string(
            self._body(), content_type="application/json", if_generation_match=generation, **kw
        )
        return int(blob.generation)

    def _acquire(self) -> None:
        failed = _precondition_failed()
        while True:
            with contextlib.suppress(failed):
                self._gen = retrying(f"creating the lock {self.url}", lambda: self._upload(0))
                return
            got = _read_lease(self.url)
            if got is None:
                continue  # released meanwhile: try to create it again
            holder, gen = got
            if holder.get("token") == self.holder["token"]:
                self._gen = gen  # our create landed, its answer did not
                return
            now = time.time()
            if not _expired(holder, now):
                raise LockBusy(
                    f"{self.what} is in use by another process ({_holder_text(holder, now)}; "
                    f"its lease of {holder.get('lease_s', '?')} s ends unless renewed): wait "
                    "for it to finish, or stop it"
                )
            try:
                self._gen = retrying(
                    f"taking over the lock {self.url}", lambda gen=gen: self._upload(gen)
                )
            except failed:
                continue  # another launch took it first: read who
            print(
                f"{self.what}: took over the lock of {_holder_text(holder, now)}, whose lease "
                "expired (its process or machine is gone)",
                file=sys.stderr,
                flush=True,
            )
            return

    def _renew_loop(self) -> None:
        every = max(self.lease_s / 8, 0.05)
        last_ok = time.time()
        while not self._stop.wait(every):
            try:
                self._renew()
                last_ok = time.time()
            except _precondition_failed():
                got = _read_lease(self.url)
                who = _holder_text(got[0]) if got else "nobody (the lock object is gone)"
                self._lose(f"the lock object was replaced: now held by {who}")
                return self._fence()
            except Exception as e:  # noqa: BLE001 - the network: keep trying while the lease lasts
                # Given up at 3/4 of the lease, so that this process has stopped before
                # another can take the lease over (at its end).
                if time.time() - last_ok > 0.75 * self.lease_s:
                    self._lose(
                        f"it could not be renewed for {time.time() - last_ok:.0f} s of its "
                        f"{self.lease_s:.0f} s lease ({_one_line(e)})"
                    )
                    return self._fence()

    def _fence(self) -> None:
        """Stop the process if it has not stopped itself by `check()` within 1/8 of the
        lease: it may be stuck waiting on storage (a checkpoint save that retries for
        minutes), and once the lease is over another host may take the run. A run
        resumes exactly from its checkpoints, so stopping it loses nothing."""
        if self._stop.wait(max(self.lease_s / 8, 0.05)):
            return  # released: the process is stopping by itself
        print(f"{self.what}: stopping this process", file=sys.stderr, flush=True)
        os._exit(STORAGE_EXIT)

    def _renew(self) -> None:
        try:
            self._gen = self._upload(self._gen, once=True)
        except _precondition_failed():
            # A retried upload whose first try did land leaves our own generation behind.
            got = _read_lease(self.url)
            if got is not None and got[0].get("token") == self.holder["token"]:
                self._gen = got[1]
                return
            raise

    def _lose(self, why: str) -> None:
        self.lost = why
        print(f"{self.what}: lost the lock: {why}; stopping", file=sys.stderr, flush=True)

    def check(self) -> None:
        """StorageError once the lock is lost (before any further write)."""
        if self.lost is not None:
            raise StorageError(f"{self.what}: lost the lock {self.url}: {self.lost}")

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.lost is not None:
            return
        try:
            got = _read_lease(self.url)
            if got is not None and got[0].get("token") == self.holder["token"]:
                _blob(self.url).delete(if_generation_match=got[1])
        except Exception as e:  # noqa: BLE001 - the lease ends by itself
            print(f"warning: could not remove the lock {self.url}: {e}", file=sys.stderr)


def acquire(root: str | os.PathLike, name: str, *, what: str) -> FileLock | LeaseLock:
    """The lock `name` of directory `root`: an flock locally, a lease in a bucket."""
    if is_remote(root):
        return LeaseLock(join(root, name), what=what)
    return FileLock(join(root, name), what=what)


def holder(root: str | os.PathLike, name: str) -> dict[str, Any] | None:
    """Who holds lock `name` of `root` now (None: nobody, or a lease that expired)."""
    if is_remote(root):
        return lease_holder(join(root, name))
    return file_lock_holder(join(root, name))
