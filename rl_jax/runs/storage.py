"""Where a run's files live: a local directory or a bucket, behind one small interface.

A run or grid directory is a path or a URL (`gs://BUCKET/runs`, any fsspec URL for
reading). `open_store(root)` gives a `Store` whose verbs are what a run does with its
files: read a file, replace it whole, append whole lines, list, move, remove.

Local directories keep POSIX semantics: a write goes to a temporary file that is
renamed into place; an append is one write + fsync of whole lines.

Objects in a bucket are immutable: an upload replaces an object whole or not at all,
and there is no append. So `BucketStore` keeps each appended-to file's content in
memory and uploads it whole when `flush()` is called (the trainer flushes before it
saves a checkpoint, after an evaluation and every `FLUSH_EVERY_S` seconds). A kill
loses at most the rows since the last flush, which are rows after the newest
checkpoint: the resumed run cuts every file back to that checkpoint's step anyway
and writes those rows again. A JSONL file is small next to a checkpoint (about 1 KB
a step), so rewriting it whole stays cheap.

Every bucket operation retries transient failures (connection errors, HTTP 408,
429 and 5xx) with exponential backoff for up to `retry_deadline_s()` seconds
($RL_JAX_STORAGE_RETRY_S, default 300), then raises `StorageError`: one line naming
the URL, the operation and the last error.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rl_jax.config import paths
from rl_jax.knobs import ConfigError

T = TypeVar("T")

# Seconds between uploads of a bucket run's appended files (besides checkpoints,
# evaluations and the end of the run).
FLUSH_EVERY_S = 30.0
# Exit status of a command stopped by storage it could not reach (EX_IOERR): not a
# config error (2), so a grid retries the run.
STORAGE_EXIT = 74


class StorageError(RuntimeError):
    """Storage failed for good (after retries), or the run lost its lock: one line."""


def retry_deadline_s() -> float:
    return float(os.environ.get("RL_JAX_STORAGE_RETRY_S", "300"))


def is_remote(root: str | os.PathLike) -> bool:
    """Whether `root` names a bucket (a URL other than file://)."""
    return paths.is_url(root) and paths.protocol(str(root)) != "file"


def join(root: str | os.PathLike, *parts: str) -> str:
    """`root/part/...` for a path or a URL (a URL keeps its `//`)."""
    if is_remote(root):
        return "/".join([str(root).rstrip("/"), *(p.strip("/") for p in parts if p)])
    return str(Path(_local_path(root), *parts))


def _local_path(root: str | os.PathLike) -> Path:
    if paths.is_url(root):  # file://
        return Path(str(root)[len("file://") :])
    return Path(root)


def open_store(root: str | os.PathLike, *, key: str = "out_dir") -> Store:
    """The store of directory `root`; `key` names the knob in error messages."""
    if is_remote(root):
        return BucketStore(str(root), key=key)
    return LocalStore(_local_path(root))


def transient(e: BaseException) -> bool:
    """Whether retrying `e` can help: the network or the service, not the request."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, FileExistsError)):
        return False
    code = getattr(e, "code", None)
    if isinstance(code, int):
        return code in (408, 429) or code >= 500
    name = type(e).__name__
    if name in ("ClientConnectorError", "ServerDisconnectedError", "ClientOSError"):
        return True
    return isinstance(e, (ConnectionError, TimeoutError, OSError))


def retrying(what: str, fn: Callable[[], T], *, deadline_s: float | None = None) -> T:
    """`fn()`, retried with backoff while it fails transiently, for up to `deadline_s`."""
    deadline_s = retry_deadline_s() if deadline_s is None else deadline_s
    start = time.monotonic()
    delay, tries = 0.5, 0
    while True:
        tries += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified just below
            if not transient(e):
                raise
            waited = time.monotonic() - start
            if waited + delay > deadline_s:
                raise StorageError(
                    f"{what} failed after {tries} tries over {waited:.0f} s: {_one_line(e)}"
                ) from e
            if tries == 1 or tries % 5 == 0:
                print(
                    f"storage: {what} failed ({_one_line(e)}); retrying for up to "
                    f"{deadline_s - waited:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 30.0)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


class Store:
    """The files of one directory. Paths given to the verbs are relative to it."""

    root: str
    remote: bool = False

    def url(self, rel: str = "") -> str:
        return join(self.root, rel) if rel else self.root

    def read_bytes(self, rel: str) -> bytes:
        """The file's bytes; FileNotFoundError when there is none."""
        raise NotImplementedError

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode("utf-8")

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def write(self, rel: str, data: bytes) -> None:
        """Replace the file whole (a reader sees the old or the new content, never part)."""
        raise NotImplementedError

    def write_text(self, rel: str, text: str) -> None:
        self.write(rel, text.encode("utf-8"))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_text(rel, json.dumps(obj, indent=2, sort_keys=True, default=_jsonable) + "\n")

    def append(self, rel: str, data: bytes) -> None:
        """Append whole lines (`data` ends in a newline)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make every append durable (a no-op where appends already are)."""

    def list(self, rel: str = "") -> list[str]:
        """Names directly under directory `rel` (files and directories), sorted."""
        raise NotImplementedError

    def remove(self, rel: str) -> None:
        """Remove a file or a whole directory; nothing to do when absent."""
        raise NotImplementedError

    def move(self, rel: str, dest: str) -> None:
        """Move a file or directory to `dest` (relative to the same root)."""
        raise NotImplementedError

    def upload_tree(self, local: Path, rel: str = "") -> None:
        """Put every file under local directory `local` at `rel/<its relative path>`."""
        for f in sorted(Path(local).rglob("*")):
            if f.is_file():
                dest = f.relative_to(local).as_posix()
                self.write(f"{rel.rstrip('/')}/{dest}" if rel else dest, f.read_bytes())

    def check_writable(self, rel: str = "") -> None:
        """Write and remove a probe file under `rel`: StorageError naming it if that fails."""
        probe = f"{rel.rstrip('/')}/.write-probe-{os.getpid()}" if rel else ".write-probe"
        try:
            self.write(probe, b"probe\n")
            self.remove(probe)
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"cannot write to {self.url(rel)}: {_os_reason(e)}") from e


def _os_reason(e: OSError) -> str:
    if e.errno is not None and e.strerror:
        return f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"
    return _one_line(e)


class LocalStore(Store):
    def __init__(self, root: Path):
        self.root = str(root)
        self._root = Path(root)

    def path(self, rel: str = "") -> Path:
        return self._root / rel if rel else self._root

    def read_bytes(self, rel: str) -> bytes:
        return self.path(rel).read_bytes()

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def write(self, rel: str, data: bytes) -> None:
        try:
            atomic_write_bytes(self.path(rel), data)
        except OSError as e:
            raise StorageError(f"cannot write {self.path(rel)}: {_os_reason(e)}") from e

    def append(self, rel: str, data: bytes) -> None:
        if data:
            try:
                append_bytes(self.path(rel), data)
            except OSError as e:
                raise StorageError(f"cannot append to {self.path(rel)}: {_os_reason(e)}") from e

    def list(self, rel: str = "") -> list[str]:
        p = self.path(rel)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def remove(self, rel: str) -> None:
        p = self.path(rel)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def move(self, rel: str, dest: str) -> None:
        d = self.path(dest)
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.path(rel)), str(d))

    def mkdir(self, rel: str = "") -> None:
        self.path(rel).mkdir(parents=True, exist_ok=True)


class BucketStore(Store):
    """A directory in a bucket through fsspec (gcsfs for gs://)."""

    remote = True

    def __init__(self, root: str, *, key: str = "out_dir"):
        self.root = root.rstrip("/")
        self.key = key
        _quiet_gcsfs_defaults()
        # No listing cache: other processes (the trainer, another host, the grid driver)
        # change what is in the bucket, and a cached listing would hide it.
        self.fs, self._inner = paths.filesystem(self.root, key, use_listings_cache=False)
        self._inner = self._inner.rstrip("/")
        self._content: dict[str, bytearray] = {}  # appended-to files, whole
        self._dirty: set[str] = set()
        self.before_write: Callable[[], None] | None = None  # e.g. the lock's check

    def _p(self, rel: str) -> str:
        return f"{self._inner}/{rel.strip('/')}" if rel else self._inner

    def _guard(self) -> None:
        if self.before_write is not None:
            self.before_write()

    def _retry(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        return retrying(f"{what} {self.url(rel)}", fn)

    def read_bytes(self, rel: str) -> bytes:
        if rel in self._content:
            return bytes(self._content[rel])
        return self._retry("reading", rel, lambda: self.fs.cat_file(self._p(rel)))

    def exists(self, rel: str) -> bool:
        if rel in self._content:
            return True
        return self._retry("looking up", rel, lambda: self.fs.exists(self._p(rel)))

    def _put(self, rel: str, data: bytes) -> None:
        self._guard()
        self._retry("writing", rel, lambda: self.fs.pipe_file(self._p(rel), data))

    def write(self, rel: str, data: bytes) -> None:
        self._put(rel, bytes(data))
        if rel in self._content:
            self._content[rel] = bytearray(data)
            self._dirty.discard(rel)

    def append(self, rel: str, data: bytes) -> None:
        if not data:
            return
        if rel not in self._content:
            try:
                old = self.read_bytes(rel)
            except FileNotFoundError:
                old = b""
            self._content[rel] = bytearray(_cut_torn(old))
        self._content[rel] += data
        self._dirty.add(rel)

    def flush(self) -> None:
        for rel in sorted(self._dirty):
            self._put(rel, bytes(self._content[rel]))
            self._dirty.discard(rel)

    def list(self, rel: str = "") -> list[str]:
        def ls() -> list[str]:
            try:
                names = self.fs.ls(self._p(rel), detail=False, refresh=True)
            except FileNotFoundError:
                return []
            return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names})

        return self._retry("listing", rel, ls)

    def remove(self, rel: str) -> None:
        self._guard()
        self._content.pop(rel, None)
        self._dirty.discard(rel)

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self._p(rel), recursive=True)

        self._retry("removing", rel, rm)

    def move(self, rel: str, dest: str) -> None:
        self._guard()
        self._retry("moving", rel, lambda: self.fs.mv(self._p(rel), self._p(dest), recursive=True))

    def mkdir(self, rel: str = "") -> None:
        """Buckets have no directories: a prefix exists once an object is under it."""


class _GcsfsGaveUp(logging.Filter):
    """Drops gcsfs's ERROR records (a traceback per request that ran out of its own
    retries): `retrying` retries further and names what failed in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _quiet_gcsfs_defaults() -> None:
    """gcsfs settings that must be in place before it first loads."""
    # Against an emulator (STORAGE_EMULATOR_HOST), gcsfs >= 2026.10 first probes the
    # bucket's type over gRPC, which an emulator does not serve, and waits 2 x 60 s.
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    log = logging.getLogger("gcsfs")
    if not any(isinstance(f, _GcsfsGaveUp) for f in log.filters):
        log.addFilter(_GcsfsGaveUp())


def _cut_torn(data: bytes) -> bytes:
    """`data` up to its last newline (a partial last line is no row)."""
    if not data or data.endswith(b"\n"):
        return data
    nl = data.rfind(b"\n")
    return data[: nl + 1] if nl >= 0 else b""


# ---- local files: atomic writes and appends --------------------------------------------


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Append whole lines with one write + fsync.

    A torn last line (a writer killed mid-write) is cut off first: appended after it,
    it would become a bad line in the middle, which readers refuse."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        _cut_torn_tail(f)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _cut_torn_tail(f) -> None:
    """Truncate an open file after its last newline (nothing to do if it ends in one)."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    f.truncate(len(_cut_torn(f.read())))


def _jsonable(x: Any):
    """A value json cannot encode: arrays (numpy, JAX) and their scalars as Python lists
    and numbers (`tolist`), anything else as its text."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def check_out_dir(root: str, key: str = "out_dir") -> None:
    """Refuse a run or grid directory URL whose storage cannot hold a run: a protocol
    without the lock a bucket run needs, or a missing package. ConfigError (exit 2)."""
    if not is_remote(root):
        return
    proto = paths.protocol(root)
    if proto not in ("gs", "gcs"):
        raise ConfigError(
            f"{key}={root!r}: run directories in a bucket need generation preconditions for "
            "their lock; supported: gs:// URLs and local paths (inputs may be any fsspec URL)"
        )
    paths.filesystem(root, key)  # gcsfs installed?
    try:
        import google.cloud.storage  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{key}={root!r}: a run directory on gs:// needs google-cloud-storage: "
            "pip install 'rl-jax[gcs]'"
        ) from None
