"""The CPU decode-attention kernel (`_cpu_attention.cc`): built once per machine, called
through XLA's FFI from inside the compiled decode loop.

Decoding on CPU is bound by reading the KV cache, and XLA:CPU reads it slowly
there: the score matmul q @ k of one decode step is a batch of [R, hd] x [hd, S]
products (R query heads per KV head, 1 or 2 in many models), which it streams
at ~8 GB/s, and it reads all S slots whether filled or not. The kernel reads
each row's visible slots once (bench model, 64 rows, 72 slots: see
`benchmarks/sampler.py` and the README's performance section for the numbers).

The shared library is compiled with the host's C++ compiler (`CXX`, default
`c++`) for the host CPU (`-march=native`) and kept in `kernel_cache_dir()`, keyed
by the source, the flags, the compiler, jaxlib's version and the CPU's
features; a later process loads it in milliseconds. Without a compiler, or with
RL_JAX_CPU_KERNELS=0, `available()` is False and the sampler keeps XLA's
attention (same results to float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.runtime import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_cpu_attention.cc")
TARGET = "rl_jax_decode_attention"
SYMBOL = "RlJaxDecodeAttention"
# -fno-math-errno lets floor/max vectorise; no -ffast-math: in a shared library it
# would also set flush-to-zero for the whole process when loaded.
CXX_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def kernel_cache_dir() -> Path:
    """RL_JAX_KERNEL_CACHE if set, else $XDG_CACHE_HOME/rl_jax/kernels (~/.cache)."""
    if os.environ.get("RL_JAX_KERNEL_CACHE"):
        return Path(os.environ["RL_JAX_KERNEL_CACHE"])
    return user_cache_dir("kernels")


def _compiler() -> str | None:
    """CXX if set (and found), else c++ or g++."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("c++") or shutil.which("g++")


def _library_path(cxx: str) -> Path:
    from rl_jax.executables import host_cpu

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CXX_FLAGS).encode(), version.encode()):
        h.update(part)
    h.update(f"{jax.lib.__version__}|{host_cpu()}".encode())
    return kernel_cache_dir() / f"decode_attention-{h.hexdigest()[:20]}.so"


def _build(cxx: str, out: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never see half a
    library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *CXX_FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load_handler(cxx: str):
    """The kernel's handler from the cached library, built first if missing; a damaged
    cache entry (it does not load) is built again, once."""
    path = _library_path(cxx)
    if not path.exists():
        _build(cxx, path)
    try:
        return getattr(ctypes.cdll.LoadLibrary(str(path)), SYMBOL)
    except (OSError, AttributeError):
        _build(cxx, path)
        return getattr(ctypes.cdll.LoadLibrary(str(path)), SYMBOL)


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernel; False where it cannot be."""
    if os.environ.get("RL_JAX_CPU_KERNELS", "1") == "0":
        return False
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler (CXX): the sampler keeps XLA's decode attention on CPU")
        return False
    try:
        handler = _load_handler(cxx)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("CPU decode-attention kernel unavailable (%s); using XLA's", e)
        return False
    return True


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    kv_start: jax.Array,
    slot,
    scale: float,
    parallel: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's k, v ([B, K, hd]) at `slot`, then attend: softmax(scale * q k^T) v
    over slots kv_start[b] .. slot of each row. Returns (attention [B, K, R, hd],
    keys, values); all float32, q [B, K, R, hd], keys in tiles [B, K, S / 16, hd, 16],
    values [B, K, S, hd]. The cache is updated in place (the results alias keys and
    values; XLA copies them first only where the inputs are still needed).

    Call only after `available()` returned True, and on arrays local to one device
    (no mesh, or inside shard_map): the call has no sharding rule. `parallel`: also
    use XLA's intra-op threads (one device on the host); with one device per core
    each device's call keeps to its own thread (bench model, 64 rows: 16% faster
    generation on one device with the threads, per core no faster with them).
    """
    f32 = jnp.float32
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct(q.shape, f32),
            jax.ShapeDtypeStruct(keys.shape, f32),
            jax.ShapeDtypeStruct(values.shape, f32),
        ),
        input_output_aliases={3: 1, 4: 2},
    )
    return call(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        keys,
        values,
        kv_start.astype(jnp.int32),
        jnp.asarray(slot, jnp.int32),
        scale=np.float32(scale),
        parallel=bool(parallel),
    )
