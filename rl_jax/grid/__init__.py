"""Experiment grids: specs, expansion into runs with stable ids, backends, resume, reports."""

from rl_jax.grid.expand import Constraint, expand, format_override
from rl_jax.grid.spec import (
    Axis,
    Budget,
    EarlyStop,
    GridSpec,
    Point,
    ReportSpec,
    known_specs,
    load_spec,
)

__all__ = [
    "Axis",
    "Budget",
    "Constraint",
    "EarlyStop",
    "GridSpec",
    "Point",
    "ReportSpec",
    "expand",
    "format_override",
    "known_specs",
    "load_spec",
]
