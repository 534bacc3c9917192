"""Mesh construction on one host or many (`jax.distributed`)."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from rl_jax.config.mesh import MeshConfig
from rl_jax.knobs import ConfigError
from rl_jax.runtime import mesh_platform
from rl_jax.sharding.rules import MESH_AXES


def resolve_axis_sizes(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """Sizes of (data, fsdp, tensor); a -1 takes the devices the others leave."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(
                f"mesh: {num_devices} devices are not divisible by the fixed axes "
                f"data={cfg.data} fsdp={cfg.fsdp} tensor={cfg.tensor}"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"mesh: data*fsdp*tensor = {math.prod(sizes)} but there are {num_devices} devices"
        )
    return tuple(sizes)  # type: ignore[return-value]


def start_jax(cfg: MeshConfig) -> None:
    """What must happen before JAX's backends start: the CPU device count, then
    `jax.distributed` (both idempotent)."""
    set_cpu_devices(cfg)
    maybe_initialize_distributed(cfg)


def set_cpu_devices(cfg: MeshConfig) -> None:
    """Apply mesh.cpu_devices (a no-op at 0). Once the backends run, the count cannot
    change: asking for another one than the CPU backend has is a ConfigError."""
    n = cfg.cpu_devices
    if n == 0:
        return
    if n == -1:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        jax.config.update("jax_num_cpu_devices", int(n))
        return
    except RuntimeError:  # the backends have started (jax's validator)
        pass
    if mesh_platform() != "cpu":
        return  # the knob is about the CPU backend; an accelerator run does not use it
    have = len(jax.devices("cpu"))
    if have != n:
        raise ConfigError(
            f"mesh.cpu_devices={cfg.cpu_devices} asks for {n} CPU devices, but JAX's CPU "
            f"backend already runs with {have} in this process; set it before any JAX "
            "computation (a fresh process), or use mesh.cpu_devices=0"
        )


def maybe_initialize_distributed(cfg: MeshConfig) -> None:
    """Start JAX's multi-controller runtime when asked (idempotent)."""
    if not cfg.distributed or jax.distributed.is_initialized():
        return
    # CPU collectives across processes need gloo; the flag only affects the CPU
    # backend, and asking for the backend here would initialize it too early.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if cfg.coordinator_address:
        kwargs["coordinator_address"] = cfg.coordinator_address
    if cfg.num_processes:
        kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id >= 0:
        kwargs["process_id"] = cfg.process_id
    jax.distributed.initialize(**kwargs)


def make_mesh(cfg: MeshConfig | None = None, devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axis types over `devices` (default: all)."""
    cfg = cfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    if cfg.num_devices:
        if cfg.num_devices > len(devices):
            raise ConfigError(f"mesh.num_devices={cfg.num_devices} but only {len(devices)} exist")
        devices = devices[: cfg.num_devices]
    shape = resolve_axis_sizes(cfg, len(devices))
    arr = np.array(devices, dtype=object).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def split_devices(devices=None, fraction: float = 0.5):
    """Two disjoint device lists (e.g. sampler / trainer in split mode)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        raise ConfigError(f"split mode needs at least 2 devices, found {len(devices)}")
    k = max(1, min(len(devices) - 1, round(len(devices) * fraction)))
    return devices[:k], devices[k:]
