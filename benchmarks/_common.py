"""Helpers shared by the benchmarks: worker protocol, memory, machine rate.

Nothing here imports JAX or torch at module level: `trl_grpo.py` runs in its own
virtual environment (torch + TRL, no JAX) and imports this file by path.

Worker protocol (rl_step.py drives one worker per framework, alternating steps):
the worker prints `@@ {json}` after its first step and after every later one,
then blocks on a line from stdin: `step` runs one more step, `stop` ends it
(it then prints a last `@@ {"final": true, ...}` line and exits).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time

from rl_jax.runtime import xla_flags_with_device_count

TAG = "@@ "
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_env(devices: int | None = None) -> dict:
    """Environment of a JAX benchmark worker: CPU, this checkout importable, and
    `devices` fake CPU devices (None: one, as a plain run gets; a test session
    forces 8, which must not leak into the worker)."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["XLA_FLAGS"] = xla_flags_with_device_count(env.get("XLA_FLAGS", ""), devices)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def emit(record: dict) -> None:
    sys.stdout.write(TAG + json.dumps(record) + "\n")
    sys.stdout.flush()


def wait_command() -> str:
    """Block until the driver says `step` or `stop` (EOF counts as stop)."""
    line = sys.stdin.readline()
    return line.strip() or "stop"


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else None


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def jax_matmul_rate(
    n: int | None = None, repeats: int | None = None, mesh=None, dtype: str = "float32"
) -> float:
    """FLOP/s of an n x n matmul (float32 unless `dtype`) on the default JAX device (best
    of `repeats`); with a `mesh`, of [n x devices, n] @ [n, n] with rows split over its
    batch axes. Default size: 1024 on CPU, 8192 (a size that fills the chip) elsewhere.

    The matmul is the model's (`rl_jax.models.layers.matmul`), at the precision the
    model's own matmuls use (full float32 for float32 operands).
    """
    import jax

    from rl_jax.models.layers import matmul

    cpu = jax.devices()[0].platform == "cpu"
    n = n or (1024 if cpu else 8192)
    repeats = repeats or (3 if cpu else 10)
    key = (n, dtype, None if mesh is None else id(mesh))
    if key not in _MATMUL:
        rows = n if mesh is None else n * mesh.devices.size
        # Random operands: zeros or constants run faster than real data on some chips.
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (rows, n), dtype)
        b = jax.random.normal(kb, (n, n), dtype) / n**0.5
        if mesh is not None:
            from rl_jax.sharding import batch_sharding, replicated

            a = jax.device_put(a, batch_sharding(mesh, 2))
            b = jax.device_put(b, replicated(mesh))
        f = jax.jit(matmul)
        f(a, b).block_until_ready()  # compile outside the timing
        _MATMUL[key] = (f, a, b)
    f, a, b = _MATMUL[key]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * a.shape[0] * n * n / best


_MATMUL: dict = {}
