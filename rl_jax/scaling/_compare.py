"""Comparing recipes by the paper's rule, and the recipe table.

ScaleRL (PAPERS.md section 1) treats +-0.02 as the error bar on A: two recipes
whose A differ by at most that are refitted with their mean A and compared by
B (higher B reaches the shared ceiling with less compute). Otherwise the higher
A wins. `rank_fits` extends the pairwise rule to many recipes by tiers.
"""

from __future__ import annotations

import csv
import io
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rl_jax.scaling._bootstrap import Bootstrap
from rl_jax.scaling._sigmoid import FitError, SigmoidFit, refit

PAPER_A_TOL = 0.02


def check_a_tol(a_tol: float) -> None:
    """A tie width is a finite number >= 0 (a negative or NaN one would leave every recipe
    outside its own tier)."""
    if not (isinstance(a_tol, numbers.Real) and math.isfinite(a_tol) and a_tol >= 0):
        raise FitError(f"a_tol={a_tol!r} must be a finite number >= 0 (the paper's: {PAPER_A_TOL})")


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Outcome of the paper's rule for two recipes."""

    winner: str | None  # None when both A and B tie exactly
    rule: str  # 'A' (asymptotes differ by more than a_tol) or 'B' (refit at a common A)
    a: tuple[float, float]
    b: tuple[float, float]  # B as fitted, or refitted at the common A for rule 'B'
    a_common: float | None
    text: str


def compare_fits(
    first: SigmoidFit,
    second: SigmoidFit,
    *,
    names: tuple[str, str] = ("first", "second"),
    a_tol: float = PAPER_A_TOL,
) -> Comparison:
    """The paper's rule: A within a_tol counts as equal; then refit both at the mean A and
    compare B."""
    check_a_tol(a_tol)
    a = (first.A, second.A)
    if abs(a[0] - a[1]) > a_tol:
        w = 0 if a[0] > a[1] else 1
        return Comparison(
            winner=names[w],
            rule="A",
            a=a,
            b=(first.B, second.B),
            a_common=None,
            text=f"{names[w]} has the higher asymptote (A {a[w]:.3f} vs {a[1 - w]:.3f}, "
            f"difference > {a_tol:g})",
        )
    common = (a[0] + a[1]) / 2
    b = (refit(first, a_fixed=common).B, refit(second, a_fixed=common).B)
    if b[0] == b[1]:
        winner, text = None, f"tie: equal A within {a_tol:g} and equal B at A = {common:.3f}"
    else:
        w = 0 if b[0] > b[1] else 1
        winner = names[w]
        text = (
            f"{names[w]} is more compute-efficient: A within {a_tol:g}, refitted at A = "
            f"{common:.3f} its B is {b[w]:.3g} vs {b[1 - w]:.3g}"
        )
    return Comparison(winner=winner, rule="B", a=a, b=b, a_common=common, text=text)


@dataclass(frozen=True, kw_only=True)
class Ranked:
    name: str
    rank: int  # 1 = best
    tier: int  # recipes of a tier have A within a_tol of the tier's best
    A: float
    B: float
    C_mid: float
    a_common: float  # the tier's mean A
    b_common: float  # B refitted at a_common (= B for a tier of one)


def rank_fits(fits: Mapping[str, SigmoidFit], *, a_tol: float = PAPER_A_TOL) -> list[Ranked]:
    """Rank recipes: tiers by A (each within a_tol of the tier's best), B at the tier's mean A
    within a tier. For two recipes this is exactly compare_fits."""
    check_a_tol(a_tol)
    order = sorted(fits, key=lambda k: -fits[k].A)
    out: list[Ranked] = []
    tier = 0
    while order:
        top = fits[order[0]].A
        members = [k for k in order if fits[k].A >= top - a_tol]
        order = [k for k in order if k not in members]
        tier += 1
        common = float(np.mean([fits[k].A for k in members]))
        if len(members) == 1:
            b_common = {members[0]: fits[members[0]].B}
        else:
            b_common = {k: refit(fits[k], a_fixed=common).B for k in members}
        for k in sorted(members, key=lambda k: -b_common[k]):
            f = fits[k]
            out.append(
                Ranked(
                    name=k,
                    rank=len(out) + 1,
                    tier=tier,
                    A=f.A,
                    B=f.B,
                    C_mid=f.C_mid,
                    a_common=common,
                    b_common=b_common[k],
                )
            )
    return out


TABLE_COLUMNS = (
    "rank",
    "recipe",
    "runs",
    "points",
    "R0",
    "A",
    "A_lo",
    "A_hi",
    "B",
    "B_lo",
    "B_hi",
    "C_mid",
    "C_mid_lo",
    "C_mid_hi",
    "tier",
    "B_at_tier_A",
    "r2",
    "reliable",
)


def recipe_table_rows(
    fits: Mapping[str, SigmoidFit],
    boots: Mapping[str, Bootstrap | None] | None = None,
    *,
    runs: Mapping[str, int] | None = None,
    a_tol: float = PAPER_A_TOL,
) -> list[dict]:
    """One dict per recipe, in rank order, with the TABLE_COLUMNS keys."""
    boots = boots or {}
    rows = []
    for r in rank_fits(fits, a_tol=a_tol):
        f, bs = fits[r.name], boots.get(r.name)
        row = {
            "rank": r.rank,
            "recipe": r.name,
            "runs": (runs or {}).get(r.name, 1),
            "points": f.n_points,
            "R0": f.R0,
            "A": f.A,
            "B": f.B,
            "C_mid": f.C_mid,
            "tier": r.tier,
            "B_at_tier_A": r.b_common,
            "r2": f.r2,
            "reliable": f.reliable,
        }
        for p in ("A", "B", "C_mid"):
            lo, hi = bs.interval(p) if bs is not None else (math.nan, math.nan)
            row[f"{p}_lo"], row[f"{p}_hi"] = lo, hi
        rows.append(row)
    return rows


def md_cell(v) -> str:
    """v as the text of one markdown table cell: a '|' escaped and line breaks turned into
    spaces, so that a run or recipe name cannot end its row or add columns."""
    return " ".join(str(v).splitlines()).replace("|", "\\|")


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.4g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.3f}"
    return md_cell(v)


def table_markdown(rows: Sequence[Mapping], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    head = "| " + " | ".join(columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body]) + "\n"


def table_csv(rows: Sequence[Mapping], columns: Sequence[str] = TABLE_COLUMNS) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if _missing(r.get(c)) else r.get(c)) for c in columns})
    return buf.getvalue()


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and not math.isfinite(v))
