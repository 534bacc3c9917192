"""Input paths that may be local or URLs: `gs://`, `memory://`, `file://`, any fsspec protocol.

Every knob naming a file a run reads (`model.path`, `data.path`, `data.val_path`,
`data.split_file`) goes through here, so a run on a TPU host reads its inputs from a
bucket as it reads them from its own disk. A plain local path is used as given (the
same `Path` calls, no copies); a URL is read through fsspec, whose protocols come from
optional packages (`gs://` needs gcsfs: `pip install 'rl_jax[gcs]'`).

Files are read as streams. A model directory is memory-mapped by its loaders, so a
URL naming one is staged once into a local cache (`stage`), keyed by the URL and the
listing of its files (name, size, version), and loaded from there.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from rl_jax.knobs import ConfigError
from rl_jax.runtime import user_cache_dir

# A URL: a scheme of two or more characters before '://' (one letter would be a drive).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")
# fsspec protocols whose package an rl_jax extra installs: protocol -> (package, extra).
_EXTRAS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
# info() fields that change when an object's content does, by file system (GCS, S3, local).
_VERSION_FIELDS = ("md5Hash", "etag", "ETag", "generation", "mtime", "LastModified", "created")
# In-process memo of staged copies: a grid resolves one model's spec for hundreds of runs.
_STAGED: dict[tuple[str, tuple[str, ...]], Path] = {}


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` names a URL (`proto://...`); a `Path` never does."""
    return isinstance(path, str) and _URL.match(path) is not None


def protocol(path: str) -> str:
    m = _URL.match(path)
    return m.group(1).lower() if m else ""


def filesystem(url: str, key: str, **options: Any) -> tuple[Any, str]:
    """(fsspec file system, path within it) of `url`; a protocol whose package is not
    installed is a ConfigError naming the knob and the package. `options` go to the file
    system's constructor (fsspec keeps one instance per set of options)."""
    import fsspec

    proto = protocol(url)
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        if proto in _EXTRAS:
            package, extra = _EXTRAS[proto]
            hint = f"{package}: pip install 'rl-jax[{extra}]'"
        else:
            hint = f"its fsspec backend ({e})"
        raise ConfigError(f"{key}={url!r}: reading {proto}:// paths needs {hint}") from None
    except ValueError as e:  # fsspec: "Protocol not known: ..."
        raise ConfigError(f"{key}={url!r}: {e}") from None


def _local(path: str | os.PathLike, key: str) -> Path | None:
    """`path` as a local Path (a `file://` URL included), or None for a remote URL."""
    if not is_url(path):
        return Path(path)
    if protocol(str(path)) == "file":
        fs, inner = filesystem(str(path), key)
        return Path(inner)
    return None


def kind(path: str | os.PathLike, key: str) -> str | None:
    """'file', 'dir', or None when nothing is there."""
    local = _local(path, key)
    if local is not None:
        return "file" if local.is_file() else "dir" if local.is_dir() else None
    fs, inner = filesystem(str(path), key)
    if fs.isfile(inner):
        return "file"
    return "dir" if fs.isdir(inner) else None


def suffix(path: str | os.PathLike) -> str:
    """The file extension of `path`'s last component ('.jsonl'), as Path.suffix gives it."""
    return Path(str(path).rstrip("/").rsplit("/", 1)[-1]).suffix


@contextlib.contextmanager
def open_input(path: str | os.PathLike, key: str) -> Iterator[IO[bytes]]:
    """`path` opened for binary reading (a local file with plain `open`)."""
    local = _local(path, key)
    if local is not None:
        with open(local, "rb") as f:
            yield f
        return
    fs, inner = filesystem(str(path), key)
    with fs.open(inner, "rb") as f:
        yield f


def read_text(path: str | os.PathLike, key: str) -> str:
    """The UTF-8 text of `path` (UnicodeDecodeError for other bytes, as Path.read_text)."""
    with open_input(path, key) as f:
        return f.read().decode("utf-8")


def list_files(path: str | os.PathLike, key: str) -> list[str]:
    """Names of the files under directory `path`, relative to it, sorted."""
    local = _local(path, key)
    if local is not None:
        return sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    fs, inner = filesystem(str(path), key)
    root = inner.rstrip("/")
    return sorted(name[len(root) + 1 :] for name in fs.find(root))


def stage(path: str | os.PathLike, key: str, *, files: Sequence[str] = ()) -> Path:
    """A local path holding the file or directory `path` names.

    A local path (or a `file://` URL) is returned as is. A remote one is copied once
    into $XDG_CACHE_HOME/rl_jax/inputs (or $RL_JAX_INPUT_CACHE): into a temporary
    directory there, renamed into place when complete, so a killed copy leaves nothing a
    later run would trust. The copy is keyed by the URL and the listing of its files
    (name, size, version): a changed object is copied anew. `files` (glob patterns)
    limits what a directory's copy holds, e.g. ("*.json",) to read a model's spec
    without its weights. A missing remote path is a ConfigError naming `key`.
    """
    local = _local(path, key)
    if local is not None:
        return local
    url = str(path)
    # A whole copy made in this process serves a request for part of it.
    for memo in ((url, ()), (url, tuple(files))):
        if memo in _STAGED and _STAGED[memo].exists():
            return _STAGED[memo]
    memo = (url, tuple(files))
    fs, inner = filesystem(url, key)
    inner = inner.rstrip("/")
    is_dir = fs.isdir(inner)
    if not is_dir and not fs.isfile(inner):
        raise ConfigError(f"{key}={url!r} does not exist")
    infos = fs.find(inner, detail=True) if is_dir else {inner: fs.info(inner)}
    listing = []
    for name, info in sorted(infos.items()):
        rel = name[len(inner) + 1 :] if is_dir else ""
        if is_dir and files and not any(fnmatch.fnmatch(rel, g) for g in files):
            continue
        version = next((str(info[f]) for f in _VERSION_FIELDS if info.get(f) is not None), "")
        listing.append((name, rel, info.get("size"), version))
    fingerprint = json.dumps([url, [x[1:] for x in listing]])
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:20]
    base = inner.rsplit("/", 1)[-1] or "input"
    root = Path(os.environ.get("RL_JAX_INPUT_CACHE") or user_cache_dir("inputs"))
    final = root / digest / base
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=final.parent))
        try:
            for name, rel, _, _ in listing:
                dest = tmp / base / rel if is_dir else tmp / base
                dest.parent.mkdir(parents=True, exist_ok=True)
                fs.get_file(name, str(dest))
            if is_dir:
                (tmp / base).mkdir(exist_ok=True)
            with contextlib.suppress(OSError):  # another process staged it first
                os.rename(tmp / base, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _STAGED[memo] = final
    return final


def check_dir_path(path, key: str) -> None:
    """A local directory a command writes (`key`: the flag or knob naming it) that is, or
    can be created as, a directory: ConfigError where it, or a folder above it, is a file.
    URLs pass (their stores check them)."""
    if is_url(str(path)):
        return
    for p in (Path(path), *Path(path).parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{key}={str(path)!r}: {p} is a file, not a directory")
            return
