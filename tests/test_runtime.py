"""rl_jax.runtime: where the persistent compilation cache goes, and that a second
process reuses what the first compiled."""

import json
import os
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


def test_accelerator_visible_reads_device_files_and_pci_vendors(monkeypatch, tmp_path):
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    monkeypatch.setattr(runtime, "_ACCELERATOR_FILES", (str(tmp_path / "dev" / "accel*"),))
    monkeypatch.setattr(runtime, "_PCI_VENDOR_FILES", str(tmp_path / "pci" / "*" / "vendor"))
    nic = tmp_path / "pci" / "0000:00:04.0"
    nic.mkdir(parents=True)
    (nic / "vendor").write_text("0x1af4\n")  # a virtio device
    assert runtime.accelerator_visible() is False
    tpu = tmp_path / "pci" / "0000:00:05.0"
    tpu.mkdir()
    (tpu / "vendor").write_text("0x1ae0\n")  # Google's: a TPU chip
    assert runtime.accelerator_visible() is True
    (tpu / "class").write_text("0x020000\n")  # Google's network function (gVNIC): no TPU
    assert runtime.accelerator_visible() is False
    (tpu / "class").write_text("0x120000\n")  # a processing accelerator
    assert runtime.accelerator_visible() is True
    (tpu / "vendor").unlink()
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "accel0").touch()
    assert runtime.accelerator_visible() is True
    monkeypatch.setattr(runtime.sys, "platform", "darwin")  # nothing to look at: keep JAX's
    (tmp_path / "dev" / "accel0").unlink()
    assert runtime.accelerator_visible() is True


def test_a_chosen_platform_is_kept(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(runtime, "accelerator_visible", lambda: False)
    assert runtime.cpu_without_accelerators() is False


_PLATFORM_CHILD = r"""
import json
from rl_jax import runtime
started = runtime.cpu_without_accelerators()
import jax, jax.numpy as jnp
jnp.ones(2).block_until_ready()
maps = open("/proc/self/maps").read()
print(json.dumps({"started": started, "visible": runtime.accelerator_visible(),
                  "backend": jax.default_backend(), "libtpu": "libtpu" in maps}))
"""


def test_a_host_without_accelerators_starts_only_the_cpu_backend():
    """No JAX_PLATFORMS and no accelerator visible: JAX runs on the CPU, as it would
    after failing to start an installed accelerator plugin, without loading it."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run(
        [sys.executable, "-c", _PLATFORM_CHILD], capture_output=True, text=True, check=True, env=env
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["started"] is (not got["visible"])
    if got["started"]:
        assert got["backend"] == "cpu"
        assert got["libtpu"] is False


def test_xla_flags_with_device_count_replaces_only_the_count():
    f = runtime.xla_flags_with_device_count
    flags = "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8 --b"
    assert f(flags, 2) == (
        "--xla_backend_optimization_level=0 --b --xla_force_host_platform_device_count=2"
    )
    assert f(flags, None) == "--xla_backend_optimization_level=0 --b"
    assert f("", 4) == "--xla_force_host_platform_device_count=4"


# What libtpu prints when it loads on a host without a TPU and nobody told it the host.
LIBTPU_NOISE = ("host bounds", "worker hostname", "E0000", "InitGoogle")


def _env_without_platforms() -> dict[str, str]:
    drop = ("JAX_PLATFORMS", *runtime._LIBTPU_LOCAL_HOST)
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_convert_on_a_cpu_host_prints_no_libtpu_noise(tmp_path):
    """`rl-jax convert` starts JAX's CPU backend alone on a host without an accelerator:
    libtpu (installed for rl-jax plan) is not loaded, so it prints nothing."""
    if runtime.accelerator_visible():
        import pytest

        pytest.skip("this host shows an accelerator: JAX's own choice is kept")
    from rl_jax.config import ModelConfig
    from rl_jax.models import build_model, export_hf, resolve_spec

    spec = resolve_spec(ModelConfig(preset="tiny", num_layers=1, hidden_size=32))
    export_hf(build_model(spec, seed=0), tmp_path / "hf")
    out = subprocess.run(
        [sys.executable, "-m", "rl_jax.cli", "convert", str(tmp_path / "hf"), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        env=_env_without_platforms(),
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["to"] == "rl_jax"
    noise = [ln for ln in out.stderr.splitlines() if any(n in ln for n in LIBTPU_NOISE)]
    assert not noise, out.stderr


_TOPOLOGY_CHILD = r"""
from rl_jax import runtime
runtime.setup()
from rl_jax.plan import topology_devices
print(len(topology_devices("v5e:2x2")), {d.device_kind for d in topology_devices("v5e:2x2")})
"""


def test_plan_loads_libtpu_quietly_and_still_describes_topologies():
    import pytest

    pytest.importorskip("libtpu")
    if runtime.accelerator_visible():
        pytest.skip("this host shows an accelerator: libtpu reads its own")
    out = subprocess.run(
        [sys.executable, "-c", _TOPOLOGY_CHILD],
        capture_output=True,
        text=True,
        env={**_env_without_platforms(), "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "4 {'TPU v5 lite'}"
    noise = [ln for ln in out.stderr.splitlines() if any(n in ln for n in LIBTPU_NOISE)]
    assert not noise, out.stderr
