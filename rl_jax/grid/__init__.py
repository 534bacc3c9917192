"""Experiment grids: specs, expansion into runs with stable ids, backends, resume, reports."""

from rl_jax.grid.expand import Constraint, RunPlan, expand, format_override, step_compute
from rl_jax.grid.spec import (
    UNITS,
    Axis,
    Budget,
    EarlyStop,
    GridSpec,
    Point,
    ReportSpec,
    Resources,
    known_specs,
    load_spec,
)

__all__ = [
    "UNITS",
    "Axis",
    "Budget",
    "Constraint",
    "EarlyStop",
    "GridSpec",
    "Point",
    "ReportSpec",
    "Resources",
    "RunPlan",
    "expand",
    "format_override",
    "known_specs",
    "load_spec",
    "step_compute",
]
