"""Ahead-of-time plans of a run's programs for TPU topologies, from any host."""

from rl_jax.plan._programs import HEADROOM, plan_run, topology_devices
from rl_jax.plan.chips import CHIPS, Chip, parse_topology

__all__ = ["CHIPS", "HEADROOM", "Chip", "parse_topology", "plan_run", "topology_devices"]
