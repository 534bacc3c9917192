"""Mesh configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import ConfigError, check_choice, check_numbers, check_range, knob

RULE_PRESETS = ("dp", "fsdp", "fsdp_tp")


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    data: int = knob(1, help="size of the data-parallel mesh axis (-1: the rest of the devices)")
    fsdp: int = knob(-1, help="size of the FSDP mesh axis (-1: the rest of the devices)")
    tensor: int = knob(1, help="size of the tensor-parallel mesh axis (-1: the rest)")
    num_devices: int = knob(0, help="use only the first this many devices (0 = all)")
    sampler_devices: int = knob(
        0,
        help="split mode: the first this many devices sample while the rest train, at the "
        "same time (0 = colocated; needs train.off_policy=pipeline)",
    )
    cpu_devices: int = knob(
        0,
        help="CPU backend only: split the host CPU into this many JAX devices (-1 = one per "
        "core; 0 = JAX's default: one, or XLA_FLAGS' --xla_force_host_platform_device_count); "
        "set before JAX starts. A device runs small matmuls (decoding) on one thread, so rows "
        "split over per-core devices (mesh.data=-1 mesh.fsdp=1) use every core",
    )
    rules: str = knob("fsdp_tp", help=f"logical-axis rule preset, one of {RULE_PRESETS}")
    distributed: bool = knob(False, help="call jax.distributed.initialize (one process per host)")
    coordinator_address: str = knob("", help="host:port of process 0 ('' = auto-detect, e.g. TPU)")
    num_processes: int = knob(0, help="number of processes (0 = auto-detect)")
    process_id: int = knob(-1, help="this process's id (-1 = auto-detect)")

    def __post_init__(self):
        check_numbers("mesh", self)
        check_range("mesh", "num_processes", self.num_processes, lo=0)
        check_range("mesh", "process_id", self.process_id, lo=-1)
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
        for k, v in sizes.items():
            if v == 0 or v < -1:
                raise ConfigError(f"mesh.{k}={v} must be a positive size or -1 (the rest)")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got {sizes}")
        check_choice("mesh", "rules", self.rules, RULE_PRESETS)
        if self.sampler_devices < 0:
            raise ConfigError(
                f"mesh.sampler_devices={self.sampler_devices} must be >= 0 (0 = colocated)"
            )
        if self.cpu_devices < -1:
            raise ConfigError(
                f"mesh.cpu_devices={self.cpu_devices} must be >= -1 (-1 = one per core, "
                "0 = JAX's default)"
            )
        if self.num_devices < 0:
            raise ConfigError(f"mesh.num_devices={self.num_devices} must be >= 0 (0 = all)")
