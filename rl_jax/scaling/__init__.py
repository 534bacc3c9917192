"""Scaling-curve fits for RL compute experiments (ScaleRL, IsoCompute); no JAX needed.

Curves in (curve rows: JSON lines, CSV, parquet), fits out: the ScaleRL sigmoid
by the paper's grid or by bounded least squares, the power law for comparison,
bootstrap intervals over evaluation points or seeds, the paper's recipe
comparison rule, extrapolation checks, the iso-compute frontier and n*(C), an
early-stopping probability, plots and a report. Runs on numpy, scipy and
matplotlib alone, so an analyst can use it on a laptop.

    from rl_jax import scaling
    fit = scaling.fit_sigmoid(x, y)                       # R0 from the first evaluation
    bs = scaling.bootstrap(fit)                           # bs.interval("A")
    report = scaling.fit_runs(rows, x="flops", metric="val/pass@1")
    scaling.write_report(report, "fits/")
    per_task = scaling.fit_tasks(rows, x="flops")          # a mixture's val/<task>/pass@1
    study = scaling.analyse_study(curves, baseline="scalerl")  # seeded leave-one-out
    iso = scaling.analyse_isocompute(rows, split_by="split")  # an iso-compute study
    alloc = scaling.allocate(frontier, curves, budget=2**20)  # (n, B_p, M) for a budget
"""

from rl_jax.scaling._allocate import Allocation, Candidate, allocate, extrapolation_note
from rl_jax.scaling._bootstrap import BOOTSTRAP_KINDS, Bootstrap, bootstrap, bootstrap_runs
from rl_jax.scaling._compare import (
    PAPER_A_TOL,
    compare_fits,
    rank_fits,
    recipe_table_rows,
    table_csv,
    table_markdown,
)
from rl_jax.scaling._curves import SOURCE_KEY, Curve, CurveError, curves_from_rows, load_rows
from rl_jax.scaling._early import Progress, early_decision, p_greater, reach_decision
from rl_jax.scaling._extrapolate import Extrapolation, extrapolation_check
from rl_jax.scaling._iso_report import iso_study_json, write_iso_study
from rl_jax.scaling._iso_study import HIST_KEY, IsoStudy, additive_fit, analyse_isocompute
from rl_jax.scaling._isocompute import FrontierError, fit_frontier, record_breaking
from rl_jax.scaling._power import fit_power_law
from rl_jax.scaling._report import (
    FRONTIER_MODES,
    FitReport,
    fit_runs,
    parse_fit_start,
    write_report,
)
from rl_jax.scaling._sigmoid import (
    PAPER_A_GRID,
    PAPER_C_MID_GRID,
    SIGMOID_METHODS,
    FitError,
    SigmoidOptions,
    fit_sigmoid,
    fit_sigmoid_runs,
    refit,
    sigmoid,
)
from rl_jax.scaling._study import PaperFinding, Study, analyse_study
from rl_jax.scaling._study_report import study_json, write_study
from rl_jax.scaling._tasks import fit_tasks, task_metrics, task_table, task_table_markdown

# Plotting pulls in matplotlib; load it on first use so fitting alone stays quick to import.
_PLOTS = ("plot_curve",)


def __getattr__(name: str):
    if name in _PLOTS:
        from rl_jax.scaling import _plots

        return getattr(_plots, name)
    raise AttributeError(f"module 'rl_jax.scaling' has no attribute {name!r}")


__all__ = [
    "SOURCE_KEY",
    "Allocation",
    "Candidate",
    "Progress",
    "BOOTSTRAP_KINDS",
    "FRONTIER_MODES",
    "PAPER_A_GRID",
    "PAPER_A_TOL",
    "PAPER_C_MID_GRID",
    "SIGMOID_METHODS",
    "Bootstrap",
    "Curve",
    "CurveError",
    "Extrapolation",
    "FitError",
    "FitReport",
    "FrontierError",
    "HIST_KEY",
    "IsoStudy",
    "PaperFinding",
    "SigmoidOptions",
    "Study",
    "additive_fit",
    "allocate",
    "analyse_isocompute",
    "analyse_study",
    "bootstrap",
    "bootstrap_runs",
    "compare_fits",
    "curves_from_rows",
    "early_decision",
    "extrapolation_check",
    "extrapolation_note",
    "fit_frontier",
    "fit_power_law",
    "fit_runs",
    "fit_sigmoid",
    "fit_sigmoid_runs",
    "fit_tasks",
    "iso_study_json",
    "load_rows",
    "p_greater",
    "parse_fit_start",
    "plot_curve",
    "rank_fits",
    "reach_decision",
    "recipe_table_rows",
    "record_breaking",
    "refit",
    "sigmoid",
    "study_json",
    "table_csv",
    "table_markdown",
    "task_metrics",
    "task_table",
    "task_table_markdown",
    "write_iso_study",
    "write_report",
    "write_study",
]
