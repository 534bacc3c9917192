"""Meshes and logical-axis rule tables; the only module that knows mesh axis names."""

from rl_jax.config.mesh import MeshConfig
from rl_jax.sharding.mesh import (
    make_mesh,
    maybe_initialize_distributed,
    resolve_axis_sizes,
    set_cpu_devices,
    split_devices,
    start_jax,
)
from rl_jax.sharding.rules import (
    BATCH_AXES,
    SAMPLE_RULES,
    batch_sharding,
    fit_spec,
    get_rules,
    logical_to_spec,
    num_batch_shards,
    replicated,
)

__all__ = [
    "BATCH_AXES",
    "SAMPLE_RULES",
    "MeshConfig",
    "batch_sharding",
    "fit_spec",
    "get_rules",
    "logical_to_spec",
    "make_mesh",
    "maybe_initialize_distributed",
    "num_batch_shards",
    "replicated",
    "resolve_axis_sizes",
    "set_cpu_devices",
    "split_devices",
    "start_jax",
]
