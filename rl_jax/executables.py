"""Compiled executables kept on disk, so that a warm process skips tracing and lowering.

JAX's persistent compilation cache (`rl_jax.runtime`) saves the XLA compile of a
program but finds it by the hash of the *lowered* program, so every process
still traces and lowers each function before the lookup: for the train step of
the bench workload that is ~1.3 s of Python in a ~3.4 s warm first step. An
`AotFunction` looks up the serialized executable itself, under a key made of
everything that determines the program, none of which needs a trace:

* `static_key`: the caller's account of what the function closes over (for the
  train step: the model spec, the sharding rules, the loss and optimizer
  configs and the sizes baked into it), built beside the call that closes over them;
* the abstract signature of the arguments: tree structure, shapes, dtypes, weak
  types and shardings (mesh axes and device ids included);
* the code: a digest of rl_jax's own source files (taken at import) and the
  versions of the libraries whose code is traced or compiles (jax, jaxlib, the
  accelerator plugins, flax, optax, numpy, ...);
* the backend and settings: platform and its version, device kinds, the host
  CPU's feature flags, process count and index, XLA_FLAGS, JAX's and flax's
  configuration flags, and rl_jax's module-level settings read while tracing.

Any difference is a miss, and a miss is the ordinary path (trace, lower, and an
XLA compile through JAX's own cache) whose result is then written only if XLA
compiled it there and then: on XLA:CPU an executable read back from JAX's cache
(or reused in memory from an earlier compile that may have been) serializes
without its kernels, and its file fails at its first call in the next run
("Function ... not found"). A file that
does not load (truncated, from another build) is reported, removed and rebuilt:
a broken cache costs a compile, never a run.

Like JAX's own cache, the directory holds machine code that is loaded and run:
it must be as trusted as the code itself.

The cache is on only where JAX's persistent cache is configured (the `rl-jax`
commands do so; `RL_JAX_COMPILE_CACHE=0` turns both off) and in single-process
runs; `RL_JAX_EXECUTABLE_CACHE=0` turns off this one alone. Where it is off, an
AotFunction is its jitted function.

A limitation that follows from the write rule: a program JAX's cache already
holds under another of our keys (e.g. after an rl_jax edit that left the
program unchanged) is never written, so it keeps the ordinary warm path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import platform
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)

SUBDIR = "rl_jax-executables"
# Whose code is traced or compiles: their versions are part of every key.
_LIBRARIES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "numpy",
    "ml_dtypes",
    "chex",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "libtpu",
)


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# Per thread (JAX records both events in the thread that compiles): XLA compiles
# entered (an in-memory reuse of an earlier compile enters none) and of those,
# the ones JAX's persistent cache answered.
_counts = threading.local()
_listening = False
_listen_lock = threading.Lock()


def _listen() -> None:
    global _listening
    with _listen_lock:
        if _listening:
            return

        def on_hit(event: str, **_) -> None:
            if event == _JAX_CACHE_HIT:
                _counts.hits = getattr(_counts, "hits", 0) + 1

        def on_compile(event: str, secs: float, **_) -> None:
            if event == _BACKEND_COMPILE:
                _counts.compiles = getattr(_counts, "compiles", 0) + 1

        jax.monitoring.register_event_listener(on_hit)
        jax.monitoring.register_event_duration_secs_listener(on_compile)
        _listening = True


def _thread_counts() -> tuple[int, int]:
    return getattr(_counts, "compiles", 0), getattr(_counts, "hits", 0)


def cache_dir() -> Path | None:
    """Where executables are kept: beside JAX's persistent cache, when one is set
    (None, i.e. off: no JAX cache, several processes, or RL_JAX_EXECUTABLE_CACHE=0)."""
    base = jax.config.jax_compilation_cache_dir
    off = os.environ.get("RL_JAX_EXECUTABLE_CACHE", "1") == "0"
    if off or not base or jax.process_count() > 1:
        return None
    return Path(base) / SUBDIR


@functools.cache
def code_digest() -> str:
    """rl_jax's source files and the traced libraries' versions, as one hash.

    Taken when this module is imported (with rl_jax's modules): a source file
    edited later in the process's life does not pass the old code's programs
    off as the new code's."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc"), *root.rglob("*.h")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    for lib in _LIBRARIES:
        try:
            version = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{lib}={version}".encode())
    return h.hexdigest()


@functools.cache
def host_cpu() -> str:
    """The host CPU's architecture and feature flags: XLA:CPU code is generated for
    them, so a cache shared between machines (a network home) must not mix them."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:  # not Linux: the architecture alone
        pass
    return f"{platform.machine()}|{hashlib.sha256(flags.encode()).hexdigest()}"


def _flax_flags() -> dict:
    import flax

    names = [n for n in dir(flax.config) if n.startswith(("flax_", "nnx_"))]
    return {n: repr(getattr(flax.config, n)) for n in sorted(names)}


def _module_constants() -> dict:
    """rl_jax's module-level settings read while tracing (tests set some of them)."""
    from rl_jax import runtime
    from rl_jax.models import layers
    from rl_jax.sampling import _decode

    return {
        "layers.CACHE_BLOCK_BYTES": layers.CACHE_BLOCK_BYTES,
        "layers.MASK_VALUE": layers.MASK_VALUE,
        "runtime.CPU_LLVM_OPT_LEVEL": runtime.CPU_LLVM_OPT_LEVEL,
        "decode.DECODE_BLOCK_MIN_SLOTS": _decode.DECODE_BLOCK_MIN_SLOTS,
        "decode.DECODE_BLOCKS": _decode.DECODE_BLOCKS,
        "decode.DECODE_BLOCK_MAX_SLOTS": _decode.DECODE_BLOCK_MAX_SLOTS,
        "decode.DECODE_BLOCK_PLATFORMS": _decode.DECODE_BLOCK_PLATFORMS,
        "decode.KEY_TILE": _decode.KEY_TILE,
    }


def _environment() -> str:
    devices = jax.devices()
    flags = {
        k: v
        for k, v in sorted(jax.config.values.items())
        if isinstance(v, bool | int | float | str | type(None))
    }
    return json.dumps(
        {
            "platform": devices[0].platform,
            "platform_version": devices[0].client.platform_version,
            "device_kinds": sorted({d.device_kind for d in devices}),
            "devices": len(devices),
            "host_cpu": host_cpu(),
            "process": [jax.process_index(), jax.process_count()],
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
            "jax_config": flags,
            "flax_config": _flax_flags(),
            "module_constants": _module_constants(),
        },
        sort_keys=True,
        default=repr,
    )


def _sharding_key(s) -> str:
    mesh = getattr(s, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        ids = [int(d.id) for d in np.asarray(mesh.devices).flat]
    elif hasattr(s, "_device_assignment"):  # in the program's order
        ids = [int(d.id) for d in s._device_assignment]
    else:
        ids = sorted(int(d.id) for d in s.device_set)
    return f"{type(s).__name__}|{s!r}|{ids}"


def signature(args: tuple) -> tuple:
    """Hashable abstract signature of positional arguments (structure, avals, shardings)."""
    leaves, tree = jax.tree.flatten(args)
    sig = []
    for x in leaves:
        if isinstance(x, jax.Array):
            sig.append((x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)), x.sharding))
        elif isinstance(x, np.ndarray | np.generic):
            sig.append((x.shape, str(x.dtype), False, None))
        else:  # a Python scalar: traced weakly typed, its value is not part of the program
            sig.append(((), type(x).__name__, True, None))
    return tree, tuple(sig)


def _call_signature(args: tuple, static: dict) -> tuple:
    """A call's in-memory key: the arguments' signature and the static keyword values."""
    return signature(args), tuple(sorted(static.items()))


def _signature_text(sig: tuple) -> str:
    tree, leaves = sig
    parts = [str(tree)]
    for shape, dtype, weak, sharding in leaves:
        sh = _sharding_key(sharding) if sharding is not None else "host"
        parts.append(f"{shape}|{dtype}|{weak}|{sh}")
    return "\n".join(parts)


def _device_ids(exe) -> list[int]:
    """Ids of the devices a compiled program runs on, in its device-assignment order."""
    for s in jax.tree.leaves((exe.input_shardings, exe.output_shardings)):
        return [int(d.id) for d in s._device_assignment]
    raise ValueError("a program without array inputs or outputs")


@dataclasses.dataclass
class PendingLoad:
    """An executable being read in the background (AotFunction.start_load)."""

    future: Future
    finish: Callable[[], None]  # wait; compile here if the file did not load


class AotFunction:
    """A jitted function whose executables are also read from and written to disk.

    Called like the jitted function. `prepare(*args)` gets the executable for
    arguments shaped like `args` ahead of the first call (loaded, or compiled and
    written) without running it. `lower` is the jitted function's.
    """

    def __init__(self, jitted, *, name: str, static_key: str, directory: Path | None = None):
        self.jitted = jitted
        self.name = name
        self.static_key = static_key
        self.directory = directory
        self._executables: dict[tuple, Any] = {}
        self.loads = 0  # executables read from disk (tests, benchmarks)

    def _dir(self) -> Path | None:
        return self.directory if self.directory is not None else cache_dir()

    def __call__(self, *args, **static):
        """Keyword arguments are the jitted function's static ones (hashable, and
        part of the key by their repr)."""
        if self._dir() is None:
            return self.jitted(*args, **static)
        sig = _call_signature(args, static)
        exe = self._executables.get(sig)
        if exe is None:
            exe = self._get(sig, args, static)
        return exe(*args)

    def prepare(self, *args, **static) -> None:
        """Load or compile the executable for arguments like `args` (not run)."""
        if self._dir() is None:
            self.jitted.lower(*args, **static).compile()  # jit's own cache keeps it
            return
        sig = _call_signature(args, static)
        if sig not in self._executables:
            self._get(sig, args, static)

    def start_load(self, *args, **static) -> PendingLoad | None:
        """Start reading the executable for arguments like `args` from disk in a
        background thread; None (nothing started) when there is no file.

        The key is computed here, in the calling thread (JAX's configuration
        contexts are per thread). `PendingLoad.finish()` joins the thread; a file
        that did not load is compiled then, in the thread that calls it.
        """
        directory = self._dir()
        if directory is None:
            return None
        sig = _call_signature(args, static)
        path = self._path(directory, sig)
        if sig in self._executables or not path.exists():
            return None
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rl_jax-load-{self.name}")
        future = pool.submit(self._load, path)
        pool.shutdown(wait=False)  # its thread ends with the load

        def finish() -> None:
            exe = future.result()
            if exe is None:
                exe = self._compile(path, args, static)
            self._executables[sig] = exe

        return PendingLoad(future, finish)

    def lower(self, *args, **static):
        return self.jitted.lower(*args, **static)

    def _cache_size(self) -> int:
        """Executables held: loaded or compiled here, or by jit when the cache is off."""
        return len(self._executables) + int(self.jitted._cache_size())

    def key(self, sig: tuple) -> str:
        """The file name's hash for a call signature (see the module docstring)."""
        args_sig, static = sig
        parts = (
            self.name,
            self.static_key,
            _signature_text(args_sig),
            repr(static),
            code_digest(),
            _environment(),
        )
        h = hashlib.sha256()
        for part in parts:
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def _path(self, directory: Path, sig: tuple) -> Path:
        return directory / f"{self.name}-{self.key(sig)}.exe"

    def _get(self, sig: tuple, args: tuple, static: dict):
        path = self._path(self._dir(), sig)
        exe = self._load(path)
        if exe is None:
            exe = self._compile(path, args, static)
        self._executables[sig] = exe
        return exe

    def _compile(self, path: Path, args: tuple, static: dict):
        """Trace, lower and compile; write the executable if XLA compiled it here."""
        _listen()
        lowered = self.jitted.lower(*args, **static)  # (may run eager ops: their compiles)
        compiles, hits = _thread_counts()
        exe = lowered.compile()
        after_compiles, after_hits = _thread_counts()
        # Only a fresh XLA compile in this thread: an executable JAX's persistent cache
        # returned, or an in-memory one of an earlier compile that may have come from
        # there, serializes without its kernels on XLA:CPU (see the module docstring).
        if after_compiles > compiles and after_hits == hits:
            self._store(path, exe)
        return exe

    def _load(self, path: Path):
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree, ids = pickle.load(f)
            by_id = {d.id: d for d in jax.devices()}
            # The program's own devices, in its order (the default is every device).
            devices = [by_id[i] for i in ids]
            exe = deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except FileNotFoundError:
            return None
        except Exception as e:  # a truncated or foreign file: rebuild it
            log.warning(
                "rl_jax: compiled %s at %s did not load (%s); recompiling", self.name, path, e
            )
            path.unlink(missing_ok=True)
            return None
        self.loads += 1
        return exe

    def _store(self, path: Path, exe) -> None:
        from jax.experimental.serialize_executable import serialize

        tmp = None
        try:
            data = pickle.dumps((*serialize(exe), _device_ids(exe)))
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written whole, then renamed: a reader never sees half a file.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except Exception as e:  # an unwritable cache costs the next process a compile
            log.warning("rl_jax: could not write compiled %s to %s (%s)", self.name, path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)


code_digest()  # now, with rl_jax's modules (see code_digest)
