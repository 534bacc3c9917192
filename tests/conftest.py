"""Test-wide setup: 8 fake CPU devices and a persistent compilation cache.

XLA_FLAGS must be set before jax is imported anywhere, hence at conftest import.
"""

import os
from pathlib import Path

# The suite's programs are tiny, so XLA:CPU's compile time is most of its time: LLVM at
# -O0 with the classic loop emitters compiles a tiny train step in ~1.5 cpu-s instead of
# ~11 (the whole suite: 30% less CPU). The programs are the same HLO; only the CPU
# backend's code generation differs. Runs, benchmarks and `make demo` keep XLA's
# defaults; `XLA_FLAGS=--xla_force_host_platform_device_count=8 make test` tests with
# them too.
TEST_XLA_FLAGS = (
    "--xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# The files that take longest, longest first (`make test`'s --durations, summed per file).
# `make test` hands whole files to its two workers in collection order; starting these
# first leaves short files for the end, so neither worker idles while the other finishes
# a long one. A file missing here only runs later; the list orders, it selects nothing.
LONGEST_FILES = (
    "test_plan.py",
    "test_grid_driver.py",
    "test_bucket.py",
    "test_perf_step.py",
    "test_resume.py",
    "test_moe.py",
    "test_train_loop.py",
    "test_reliability.py",
    "test_smollm2.py",
    "test_train_distributed.py",
    "test_study.py",
    "test_train_kl_reward.py",
    "test_plan_recipes.py",
    "test_engine.py",
    "test_lora.py",
    "test_scaling_intervals.py",
    "test_kernels_tpu.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_runtest_setup(item):
    # The suite runs on 8 fake CPU devices; on a real accelerator (JAX_PLATFORMS=cuda,
    # one GPU) the tests that build 8-device meshes skip instead of failing.
    import pytest

    marker = item.get_closest_marker("devices")
    if marker is not None and jax.device_count() < marker.args[0]:
        pytest.skip(
            f"needs {marker.args[0]} devices; {jax.devices()[0].platform} has {jax.device_count()}"
        )


@pytest.fixture
def no_compilation_cache():
    """The persistent compilation cache off for a test that compiles for a TPU topology:
    an executable for chips this host lacks cannot be loaded back."""
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """One fake-gcs-server per test process (tests/_workers/gcs_emulator.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "_workers"))
    from gcs_emulator import GcsEmulator

    emu = GcsEmulator(tmp_path_factory.mktemp("gcs") / "objects")
    emu.start()
    yield emu
    emu.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch, request):
    """A bucket of its own on the session's GCS server, this process's environment
    pointed at the server (subprocesses inherit it). Yields the server; the bucket is
    `gcs.bucket`, its URL `gcs.base`."""
    import re

    for k, v in gcs_server.env().items():
        monkeypatch.setenv(k, v)
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") or "bucket"
    gcs_server.create_bucket(name)
    gcs_server.bucket = name
    gcs_server.base = f"gs://{name}"
    return gcs_server
