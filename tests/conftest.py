"""Test-wide setup: 8 fake CPU devices and a persistent compilation cache.

XLA_FLAGS must be set before jax is imported anywhere, hence at conftest import.
"""

import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "jax"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_runtest_setup(item):
    # The suite runs on 8 fake CPU devices; on a real accelerator (JAX_PLATFORMS=cuda,
    # one GPU) the tests that build 8-device meshes skip instead of failing.
    import pytest

    marker = item.get_closest_marker("devices")
    if marker is not None and jax.device_count() < marker.args[0]:
        pytest.skip(
            f"needs {marker.args[0]} devices; {jax.devices()[0].platform} has {jax.device_count()}"
        )
