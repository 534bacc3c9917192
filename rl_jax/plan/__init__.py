"""Ahead-of-time plans of a run's programs for TPU topologies, from any host."""

from rl_jax.plan._programs import (
    HEADROOM,
    SCALERL_BUDGET_ROLLOUTS,
    compile_jobs,
    plan_run,
    topology_devices,
)
from rl_jax.plan._search import search
from rl_jax.plan.chips import CHIPS, Chip, parse_topology

__all__ = [
    "CHIPS",
    "HEADROOM",
    "SCALERL_BUDGET_ROLLOUTS",
    "Chip",
    "compile_jobs",
    "parse_topology",
    "plan_run",
    "search",
    "topology_devices",
]
