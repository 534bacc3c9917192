"""Orbax checkpoints of everything the next step depends on.

Layout: <run>/checkpoints/<step>/{state (arrays), meta (JSON)}, on a local disk or
in a bucket (gs://; TensorStore writes the arrays there itself). Orbax writes into a
temporary directory and renames it on commit (on a disk) or marks the step with a
commit_success.txt written last (in a bucket), so a process killed mid-save leaves
no half-checkpoint that counts as a step.

Files can still be damaged later (a disk, a copy, a hand). Each save records a
checksum of every array and of the meta, and a restore recomputes them: a
checkpoint that does not load or does not match is unusable, the newest usable
one is restored, and the unusable ones are moved to <run>/checkpoints.unusable/
(kept for inspection, out of orbax's rotation: a resumed run saves those steps
again, and `keep` rotation only ever counts checkpoints of the run's own
trajectory). A state with NaN/Inf in it is never saved: resuming it is useless
and its save would rotate a good checkpoint out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding

from rl_jax.runs.storage import StorageError, is_remote, open_store
from rl_jax.sharding import replicated

log = logging.getLogger(__name__)

CHECKSUMS = "checksums"  # meta key: {array path: hex digest}
META_DIGEST = "meta_sha256"  # meta key: sha256 of the rest of the meta


class _OrbaxSaveErrors(logging.Filter):
    """Drops orbax's ERROR records: a failed background save is logged with its traceback
    by several of orbax's threads, and `Checkpointer.wait` raises it once, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


logging.getLogger("absl").addFilter(_OrbaxSaveErrors())


class ChecksumError(ValueError):
    """A restored checkpoint's arrays or meta differ from what was saved."""


class Checkpointer:
    """compress: zstd-compress the arrays (orbax's default; about 8% smaller on disk for
    float32 weights), which makes the save encode every array into new host buffers at
    once: 1.4 GB on top of a 1.5 GB state (benchmarks/memory.py). Uncompressed, the
    arrays are written from where they are."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 2,
        async_save: bool = True,
        compress: bool = False,
    ):
        self.remote = is_remote(directory)
        if self.remote:
            from etils import epath

            self.url = str(directory).rstrip("/")
            where = epath.Path(self.url)
        else:
            where = Path(directory).resolve()
            where.mkdir(parents=True, exist_ok=True)
            self.url = str(where)
        parent, _, self.name = self.url.rpartition("/")
        self._store = open_store(parent)
        self._pending: int | None = None  # the step of the save in flight
        self._mngr = ocp.CheckpointManager(
            where,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
                # Saves a killed process left half-written are removed, not kept forever.
                cleanup_tmp_directories=True,
            ),
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(use_compression=compress),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    @property
    def unusable_dir(self) -> str:
        return self._store.url(f"{self.name}.unusable")

    def step_url(self, step: int) -> str:
        return f"{self.url}/{step}"

    def steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        """state: a pytree of jax/numpy arrays; meta: JSON (iterator state, counters, ...).

        Returns False (and saves nothing) when the state holds a NaN or Inf."""
        sums, nonfinite = state_checksums(state)
        if nonfinite:
            bad = ", ".join(k for k, n in nonfinite.items() if n)
            print(
                f"warning: not saving the checkpoint of step {step}: NaN/Inf in {bad}",
                flush=True,
            )
            return False
        meta = seal_meta({**meta, CHECKSUMS: sums})
        if self._pending is not None:
            self.wait()  # one save at a time (orbax's own rule): its failure names its step
        self._pending = step
        try:  # the save's start (its directory, the arrays' copies) is synchronous
            self._mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)
                ),
                force=force,
            )
        except Exception as e:
            self._pending = None
            if not _unreachable(e) and not isinstance(e, OSError):
                raise
            raise self._save_failed(step, e) from e
        return True

    def _save_failed(self, step: int | None, e: Exception) -> StorageError:
        return StorageError(
            f"saving the checkpoint of step {step} to {self.url} failed: {_short(e)}"
        )

    def wait(self) -> None:
        """Wait for the save in flight; StorageError (one line) if it failed."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax re-raises the background failure
            step, self._pending = self._pending, None
            raise self._save_failed(step, e) from e
        self._pending = None

    def poll(self) -> None:
        """Raise (as `wait`) if the save in flight has failed; never blocks. Orbax reports
        a background save's failure only when waited on, i.e. at the next save."""
        if self._pending is not None and not self._mngr.is_saving_in_progress():
            self.wait()

    def reload(self) -> None:
        self._mngr.reload()

    def discard(self, dest: str) -> None:
        """Move every step (and half-written ones) to `dest`, a URL beside this one."""
        self.wait()
        prefix = self._store.url("")
        rel = dest[len(prefix) :].lstrip("/") if dest.startswith(prefix) else None
        if rel is None:
            raise ValueError(f"{dest} is not beside {self.url}")
        for name in self._store.list(self.name):
            self._store.move(f"{self.name}/{name}", f"{rel}/{name}")
        self.reload()

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """Restore the newest checkpoint that loads and verifies, onto the shardings of
        `abstract_state`; checkpoints newer than it are moved out of the rotation.

        `abstract_state` is a pytree of jax.ShapeDtypeStruct (with .sharding) or
        arrays; returns (step, state, meta) or None when there is no usable checkpoint.
        """
        target = jax.tree.map(_abstract, abstract_state)
        bad: list[int] = []
        found = None
        for step in reversed(self.steps()):
            try:
                out = self._mngr.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(
                            item=target,
                            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        ),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
                meta = verify(out["state"], dict(out["meta"]))
                found = step, out["state"], meta
                break
            except Exception as e:  # noqa: BLE001 - any damage means: try the previous one
                if self.remote and _unreachable(e):
                    # The bucket, not the checkpoint: a good checkpoint is never set aside
                    # for an outage.
                    raise StorageError(
                        f"reading checkpoint {self.step_url(step)} failed: {_short(e)}"
                    ) from e
                log.warning("checkpoint %d in %s is unusable: %s", step, self.url, _short(e))
                print(
                    f"warning: checkpoint {self.step_url(step)} is unusable "
                    f"({_short(e)}); falling back to an older one",
                    flush=True,
                )
                bad.append(step)
        if bad:
            self._set_aside(bad)
        return found

    def _set_aside(self, steps: list[int]) -> None:
        """Move unusable checkpoints out of orbax's directory (only the first process)."""
        self._mngr.wait_until_finished()
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step in steps:
                src = f"{self.name}/{step}"
                if self._store.exists(src):
                    self._store.move(src, f"{self.name}.unusable/{step}-{stamp}")
                    print(
                        f"moved unusable checkpoint {self.step_url(step)} to {self.unusable_dir}",
                        flush=True,
                    )
        self._mngr.reload()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._mngr.close()


def seal_meta(meta: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    return {**body, META_DIGEST: _meta_digest(body)}


def verify(state: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Check a restored state and meta against the checksums saved with them.

    Returns the meta without the checksum entries. A checkpoint saved without them
    (before they existed) is accepted as it is."""
    body = {k: v for k, v in meta.items() if k != META_DIGEST}
    if META_DIGEST in meta and meta[META_DIGEST] != _meta_digest(body):
        raise ChecksumError("the meta JSON does not match its checksum")
    saved = body.pop(CHECKSUMS, None)
    if saved is not None:
        got, _ = state_checksums(state)
        for k in sorted(set(saved) | set(got)):
            if saved.get(k) != got.get(k):
                raise ChecksumError(f"array {k} does not match its checksum")
    return body


def _meta_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def state_checksums(state: Any) -> tuple[dict[str, str], dict[str, int]]:
    """({array path: 64-bit hex digest}, {array path: NaN/Inf count}) of a pytree.

    Computed where the arrays live (one jitted pass, nothing copied to the host but the
    sums): two position-weighted sums of each element's bits, modulo 2^32. Integer
    sums do not depend on the order of summation, so a sharded array gives the same
    digest on any mesh."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    if not leaves:
        return {}, {}
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    arrays = [x for _, x in leaves]
    out = _checksum_fn(arrays)(arrays)
    sums, bad = jax.device_get(out)
    digests = {n: f"{int(a):08x}{int(b):08x}" for n, (a, b) in zip(names, sums, strict=True)}
    nonfinite = {n: int(c) for n, c in zip(names, bad, strict=True)}
    return digests, {k: v for k, v in nonfinite.items() if v}


def _checksum_fn(arrays):
    named = [a.sharding for a in arrays if isinstance(getattr(a, "sharding", None), NamedSharding)]
    return _jitted_checksums(named[0].mesh if named else None)


@functools.cache
def _jitted_checksums(mesh):
    out_sh = replicated(mesh) if mesh is not None else None
    return jax.jit(_checksums, out_shardings=out_sh)


# Elements per piece of a checksum: the jitted pass walks each array in pieces of this
# size, so its temporaries are a few MB, not the state's size (summed whole, the
# element-wise products of a 1.5 GB state took 4.7 GB of host memory at once).
CHECKSUM_CHUNK = 1 << 20


def _checksums(arrays):
    sums, bad = zip(*[_array_checksum(jnp.asarray(x)) for x in arrays], strict=True)
    return jnp.stack(sums), jnp.stack(bad)


def _array_checksum(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([2] uint32 sums, NaN/Inf count) of one array, a CHECKSUM_CHUNK piece at a time:
    sums modulo 2^32 do not depend on how the elements are grouped. Positions are
    uint32, as they always were: an array holds at most 2^32 elements."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    # Each piece is sliced from the array itself and converted there: a converted copy
    # of the whole array, read by the loop, would be materialized.
    flat = x.reshape(-1)
    inexact = jnp.issubdtype(x.dtype, jnp.inexact)
    words = 2 if np.dtype(x.dtype).itemsize == 8 else 1  # uint32 words per element
    n = flat.size
    full = n // CHECKSUM_CHUNK

    def piece(start, size, total):
        f = lax.dynamic_slice_in_dim(flat, start, size)
        b = _bits_u32(f).reshape(-1)
        i = lax.iota(jnp.uint32, size * words) + start * jnp.uint32(words)
        s = _weighted_sums(b, i)
        c = jnp.sum(~jnp.isfinite(f), dtype=jnp.int32) if inexact else jnp.zeros((), jnp.int32)
        return total[0] + s, total[1] + c

    total = (jnp.zeros((2,), jnp.uint32), jnp.zeros((), jnp.int32))
    if full:
        total = lax.fori_loop(
            0,
            full,
            lambda k, t: piece(k.astype(jnp.uint32) * CHECKSUM_CHUNK, CHECKSUM_CHUNK, t),
            total,
        )
    if n - full * CHECKSUM_CHUNK:
        total = piece(jnp.uint32(full * CHECKSUM_CHUNK), n - full * CHECKSUM_CHUNK, total)
    return total


def _weighted_sums(bits: jax.Array, i: jax.Array) -> jax.Array:
    """Two position-weighted sums (uint32, modulo 2^32) of elements' bits at positions i."""
    w1 = i * jnp.uint32(2654435761) + jnp.uint32(1)
    w2 = (i ^ jnp.uint32(0x5BD1E995)) * jnp.uint32(0x85EBCA6B) | jnp.uint32(1)
    return jnp.stack(
        [
            jnp.sum(bits * w1, dtype=jnp.uint32),
            jnp.sum((bits ^ (bits >> 15)) * w2, dtype=jnp.uint32),
        ]
    )


def _bits_u32(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = np.dtype(x.dtype).itemsize  # (keys are their key data here: _array_checksum)
    if size in (4, 8):
        return lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2] of 8 bytes
    if size == 2:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    raise TypeError(f"cannot checksum dtype {x.dtype}")


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


# What TensorStore and the HTTP clients say when a bucket could not be reached.
_UNREACHABLE = (
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "Connection refused",
    "Cannot connect",
    "ClientConnectorError",
)


def _unreachable(e: BaseException) -> bool:
    """Whether `e` (or what caused it) is the storage being out of reach."""
    for _ in range(16):
        if isinstance(e, (StorageError, ConnectionError, TimeoutError)):
            return True
        if any(m in str(e) for m in _UNREACHABLE):
            return True
        inner = e.__cause__ or e.__context__
        if inner is None:
            return False
        e = inner
    return False


def _short(e: BaseException) -> str:
    """One line naming what failed. Orbax wraps TensorStore's reason, which names the tensor
    and file, in a ~60-line spec dump; the reason is the innermost cause."""
    dump = str(e)
    for _ in range(8):
        inner = e.__cause__ or e.__context__
        if inner is None:
            break
        e = inner
    lines = str(e).strip().splitlines()
    text = lines[0].split(" See full TensorStore details")[0] if lines else type(e).__name__
    # Without a cause the dump's relative kvstore path is the tensor ('params.embed/').
    tensor = re.findall(r"'path': '([^/'][^']*?)/?'", dump)
    if tensor and tensor[-1] not in text:
        text = f"tensor {tensor[-1]!r}: {text}"
    return f"{type(e).__name__}: {text[:300]}"
