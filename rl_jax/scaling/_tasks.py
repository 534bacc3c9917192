"""Per-task fits of a task mixture's curves (ScaleRL's math + code figure).

A mixture run writes, beside the mixture's `val/pass@1`, one column per task:
`val/<task>/pass@1` (rl_jax.train.evaluation). `task_metrics` finds those columns for
any metric of the form `<prefix><leaf>` (val/pass@1 -> val/<task>/pass@1, val/best@k ->
val/<task>/best@k); `fit_tasks` fits each as `fit_runs` fits one metric.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from rl_jax.scaling._compare import md_cell
from rl_jax.scaling._report import FitReport, fit_runs
from rl_jax.scaling._sigmoid import FitError


def task_metrics(rows: Sequence[Mapping[str, Any]], metric: str = "val/pass@1") -> dict[str, str]:
    """{task: its column} for the tasks whose `metric` the rows carry, in first-seen order."""
    prefix, _, leaf = metric.rpartition("/")
    pattern = re.compile(rf"{re.escape(prefix)}/([A-Za-z][A-Za-z0-9_.-]*)/{re.escape(leaf)}")
    out: dict[str, str] = {}
    for r in rows:
        for key in r:
            m = pattern.fullmatch(key)
            if m and m.group(1) not in out:
                out[m.group(1)] = key
    return out


def fit_tasks(
    rows: Sequence[Mapping[str, Any]], *, metric: str = "val/pass@1", **fit_kwargs
) -> dict[str, FitReport | str]:
    """{task: fit_runs of its column, or why it could not be fitted} for every task of the
    rows (`task_metrics`); `fit_kwargs` as `fit_runs` takes them."""
    out: dict[str, FitReport | str] = {}
    for task, column in task_metrics(rows, metric).items():
        try:
            out[task] = fit_runs(rows, metric=column, **fit_kwargs)
        except FitError as e:
            out[task] = str(e)
    return out


def task_table(fits: Mapping[str, FitReport | str]) -> list[dict[str, Any]]:
    """One row per (task, run or recipe): its fitted A, B, C_mid, R0, points, or the error."""
    out = []
    for task, rep in fits.items():
        if isinstance(rep, str):
            out.append({"task": task, "name": "-", "error": rep})
            continue
        for e in rep.entries:
            row: dict[str, Any] = {"task": task, "name": e.name, "kind": e.kind}
            if e.fit is None:
                row["error"] = e.error or "no fit"
            else:
                row |= {k: getattr(e.fit, k) for k in ("A", "B", "C_mid", "R0")}
                row |= {"points": e.fit.n_points, "r2": e.fit.r2, "reliable": e.fit.reliable}
            out.append(row)
    return out


def task_table_markdown(rows: list[dict[str, Any]], x: str) -> str:
    lines = [
        f"| task | run / recipe | A | B | C_mid ({x}) | R0 | points | R^2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            name, error = md_cell(r["name"]), md_cell(r["error"])
            lines.append(f"| {r['task']} | {name} | no fit: {error} | | | | | |")
            continue
        flag = "" if r["reliable"] else " (unreliable)"
        lines.append(
            f"| {r['task']} | {md_cell(r['name'])}{flag} | {r['A']:.3f} | {r['B']:.2f} | "
            f"{r['C_mid']:.3g} | {r['R0']:.3f} | {r['points']} | {r['r2']:.3f} |"
        )
    return "\n".join(lines)
