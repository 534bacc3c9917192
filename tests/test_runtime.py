"""rl_jax.runtime: where the persistent compilation cache goes, and that a second
process reuses what the first compiled."""

import json
import subprocess
import sys

from rl_jax import runtime


def test_cache_dir_env_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "explicit"))
    assert runtime.compile_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.compile_cache_dir() == tmp_path / "xdg" / "rl_jax" / "jax"
    monkeypatch.setenv("RL_JAX_COMPILE_CACHE", "0")
    assert runtime.compile_cache_dir() is None


_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from rl_jax.runtime import enable_compile_cache, trim_heap_after_compiles
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
enable_compile_cache(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache even tiny programs
trimmed = trim_heap_after_compiles() and trim_heap_after_compiles()  # idempotent
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() * 3.0 + 0.25)
print(json.dumps({"y": float(f(jnp.ones((8, 8)))), "trim": trimmed,
                  "hits": sum("cache_hits" in e for e in events)}))
"""


def test_second_process_loads_from_the_cache(tmp_path):
    cache = tmp_path / "cache"

    def run():
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(cache)],
            capture_output=True,
            text=True,
            check=True,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert any(cache.iterdir()), "the first process wrote nothing to the cache"
    second = run()
    assert first["y"] == second["y"]
    assert first["trim"] is True
    assert first["hits"] == 0 and second["hits"] >= 1


def test_cpu_scheduler_keeps_results():
    """The memory-minimizing scheduler orders instructions; the numbers are XLA's default
    schedule's, bit for bit."""
    import jax
    import jax.numpy as jnp

    opts = runtime.xla_options()
    assert opts["xla_cpu_scheduler_type"] == runtime.CPU_SCHEDULER

    def f(w, x):
        for _ in range(3):
            x = jnp.tanh(x @ w) + jnp.sin(x).sum(axis=0)
        return x, jax.nn.log_softmax(x @ w.T, axis=-1).sum()

    w = jax.random.normal(jax.random.key(0), (48, 48))
    x = jax.random.normal(jax.random.key(1), (16, 48))
    ref = jax.jit(f)(w, x)
    out = jax.jit(f, compiler_options={"xla_cpu_scheduler_type": runtime.CPU_SCHEDULER})(w, x)
    for a, b in zip(out, ref, strict=True):
        assert (a == b).all()


def test_freed_buffers_go_back_to_the_os():
    assert runtime.unmap_freed_buffers() is True  # glibc (Linux)
