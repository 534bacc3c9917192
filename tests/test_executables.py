"""On-disk executables (rl_jax.executables): a hit skips tracing, any change of what
determines the program is a miss, a broken file is rebuilt, donation survives."""

import logging
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import executables
from rl_jax.executables import AotFunction

ROOT = Path(__file__).resolve().parents[1]


# A constant no earlier test session compiled: JAX's persistent cache (the suite
# shares one, conftest) then never holds these programs, whose executables the
# tests expect written. (A run on a loaded machine can take over the cache's 0.5 s
# threshold to compile them, and the next session found them there.) Adding it
# leaves every value as it is.
_SALT = float(np.float32(uuid.uuid4().int % 999_983 + 1) * np.float32(1e-30))


def _make(directory, traces, *, static_key="k"):
    def f(x, y, *, n=1):
        traces.append(1)  # runs once per trace
        return jnp.tanh(x @ y) * 2 + n + _SALT

    jitted = jax.jit(f, static_argnames=("n",))
    return AotFunction(jitted, name="f", static_key=static_key, directory=directory)


def _args(rows=4):
    x = jnp.asarray(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) / 10)
    y = jnp.asarray(np.ones((3, 2), np.float32))
    return x, y


def test_second_function_loads_without_tracing(tmp_path):
    traces: list = []
    first = _make(tmp_path, traces)
    assert first.start_load(*_args(), n=3) is None  # nothing on disk yet
    want = np.asarray(first(*_args(), n=3))
    assert len(traces) == 1 and first.loads == 0
    assert len(list(tmp_path.glob("f-*.exe"))) == 1

    traces.clear()
    second = _make(tmp_path, traces)  # a new process would build exactly this
    assert second.start_load(*_args(), n=4) is None  # another static value: no file
    pending = second.start_load(*_args(), n=3)
    assert pending is not None
    pending.finish()  # read in a background thread
    got = np.asarray(second(*_args(), n=3))
    assert traces == [] and second.loads == 1  # read from disk, never traced
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(want, np.tanh(np.asarray(_args()[0]) @ np.ones((3, 2))) * 2 + 3)
    second(*_args(), n=3)
    assert second.loads == 1 and second._cache_size() == 1  # held in memory after that


@pytest.mark.parametrize(
    "change",
    ["static_key", "shape", "dtype", "static_arg", "code", "jax_flag"],
)
def test_anything_that_changes_the_program_is_a_miss(tmp_path, monkeypatch, change):
    traces: list = []
    _make(tmp_path, traces)(*_args(), n=3)
    key = "k"
    x, y = _args()
    n = 3
    if change == "static_key":
        key = "k2"  # e.g. another loss config closed over
    elif change == "shape":
        x, y = _args(rows=8)
    elif change == "dtype":
        x = x.astype(jnp.bfloat16)
    elif change == "static_arg":
        n = 4
    elif change == "code":
        monkeypatch.setattr(executables, "code_digest", lambda: "edited source")
    traces.clear()
    again = _make(tmp_path, traces, static_key=key)
    if change == "jax_flag":
        with jax.default_matmul_precision("highest"):
            again(x, y, n=n)
    else:
        again(x, y, n=n)
    assert again.loads == 0 and traces == [1]
    assert len(list(tmp_path.glob("f-*.exe"))) == 2


def test_sharding_is_part_of_the_key(tmp_path):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    traces: list = []
    x, y = _args()
    _make(tmp_path, traces)(x, y)
    on_1 = [jax.device_put(a, jax.devices()[1]) for a in (x, y)]
    again = _make(tmp_path, traces)
    out = again(*on_1)
    assert again.loads == 0 and len(traces) == 2
    assert out.devices() == {jax.devices()[1]}


def test_broken_file_is_rebuilt(tmp_path, caplog):
    traces: list = []
    want = np.asarray(_make(tmp_path, traces)(*_args()))
    (path,) = tmp_path.glob("f-*.exe")
    path.write_bytes(path.read_bytes()[:100])  # truncated, as by a full disk
    fresh = _make(tmp_path, traces)
    with caplog.at_level(logging.WARNING, logger="rl_jax.executables"):
        got = np.asarray(fresh(*_args()))
    assert "did not load" in caplog.text and str(path) in caplog.text
    np.testing.assert_array_equal(got, want)
    assert fresh.loads == 0 and len(traces) == 2
    assert _make(tmp_path, traces)(*_args()) is not None
    assert path.stat().st_size > 100  # rewritten whole


def test_loaded_executable_still_donates(tmp_path):
    def make():
        jitted = jax.jit(lambda x, y: x * 2 + y.sum() + _SALT, donate_argnums=(0,))
        return AotFunction(jitted, name="donor", static_key="k", directory=tmp_path)

    make()(*_args())
    loaded = make()
    x, y = _args()
    out = loaded(x, y)
    assert loaded.loads == 1
    assert x.is_deleted() and not y.is_deleted()  # x's buffer became the output
    np.testing.assert_allclose(out, np.asarray(_args()[0]) * 2 + 6)


def test_off_without_a_compilation_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(executables, "cache_dir", lambda: None)
    traces: list = []
    f = _make(None, traces)
    assert f.start_load(*_args()) is None
    f(*_args())
    f(*_args())
    assert traces == [1] and f._cache_size() == 1  # plain jit
    assert not any(tmp_path.iterdir())


_CHILD = """
import json, sys
from rl_jax.runtime import enable_compile_cache
enable_compile_cache(sys.argv[1])
import jax, jax.numpy as jnp
from rl_jax.executables import AotFunction
traces = []
def f(x):
    traces.append(1)
    return jnp.sin(x) * 2
g = AotFunction(jax.jit(f), name="child", static_key=sys.argv[2])
y = g(jnp.arange(4.0))
print(json.dumps({"y": [float(v) for v in y], "traces": len(traces), "loads": g.loads}))
"""


def test_second_process_skips_the_trace(tmp_path):
    import json

    cache = tmp_path / "cache"

    def run(static_key):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(cache), static_key],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run("v1"), run("v1")
    assert (first["traces"], first["loads"]) == (1, 0)
    assert (second["traces"], second["loads"]) == (0, 1)
    assert first["y"] == second["y"]
    # Another key for the same program: JAX's cache supplies the executable, which
    # must not be written (on CPU it would not run when read back).
    third, fourth = run("v2"), run("v2")
    assert third["loads"] == fourth["loads"] == 0
    assert third["y"] == fourth["y"] == first["y"]
    assert len(list((cache / executables.SUBDIR).glob("child-*.exe"))) == 1


def test_cache_dir_follows_jax_cache_and_the_switch(monkeypatch):
    base = jax.config.jax_compilation_cache_dir  # conftest sets one
    assert executables.cache_dir() == Path(base) / executables.SUBDIR
    monkeypatch.setenv("RL_JAX_EXECUTABLE_CACHE", "0")
    assert executables.cache_dir() is None


def test_executable_compiled_earlier_in_the_process_is_not_written(tmp_path):
    # jit reuses an in-memory compile with no XLA compile (and no cache event): that
    # executable may have come from JAX's cache, whose files would not run.
    traces: list = []
    f = _make(tmp_path, traces)
    f.lower(*_args()).compile()  # compiled through jit, outside the executable cache
    f(*_args())
    assert not list(tmp_path.glob("f-*.exe"))
    g = _make(tmp_path / "other", traces, static_key="fresh")
    g(*_args(rows=5))  # a real compile: written
    assert len(list((tmp_path / "other").glob("f-*.exe"))) == 1
