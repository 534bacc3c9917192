"""`rl-jax allocate --from FITS_OR_GRID --budget C [--topology T] [key=value ...]`: the
compute-optimal (n, B_p, M) for a budget from an iso-compute grid's fitted frontier
(rl_jax.scaling.allocate), with its bootstrap interval, and with a topology each
candidate priced by `rl-jax plan --search --estimate-only` (rollouts per hour, chip-hours
to spend C), printed as the command that trains it.

FITS_OR_GRID: a grid directory (its curves.jsonl, and plan.json for each cell's
overrides), a fits/<split> directory of one (that split), or a curve file. The frontier
is refitted from the curves (seconds), so that every n's sigmoid can be bootstrapped."""

from __future__ import annotations

import argparse
import json
import math
import os
import posixpath
import re
import shlex
import sys
from typing import Any

from rl_jax.cli import raw_parser
from rl_jax.knobs import ConfigError

UNITS = {"rollouts": "rollouts", "tokens": "generated_tokens", "flops": "flops"}
CURVES = "curves.jsonl"
CURVE_SUFFIXES = (".jsonl", ".csv", ".parquet")
# Knobs the allocation sets; a cell's own values of them are dropped from its overrides.
SET_KEYS = ("sampling.n", "data.prompts_per_batch", "train.steps", "eval.every")


def build_parser() -> argparse.ArgumentParser:
    p = raw_parser("rl-jax allocate", __doc__)
    p.add_argument("--from", dest="src", required=True, metavar="FITS_OR_GRID")
    p.add_argument("--budget", required=True, help="compute C to spend, in --unit (e.g. 1e6)")
    p.add_argument(
        "--unit",
        default=None,
        help=f"what C counts: one of {', '.join(UNITS)} (default: the grid's compute column)",
    )
    p.add_argument("--split", default=None, help="the split whose frontier to use (e.g. easy)")
    p.add_argument("--metric", default=None, help="metric (default: the grid's, or val/pass@1)")
    p.add_argument("--topology", default=None, help="price candidates on a TPU topology")
    p.add_argument("--recipe", default=None, help="recipe to train (default: the grid's)")
    p.add_argument("--level", type=float, default=0.95, help="interval level")
    p.add_argument("--n-boot", type=int, default=200, help="bootstrap replicates per n")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value for the run")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_intermixed_args(argv)
    budget = _budget(a.budget)
    if a.unit is not None and a.unit not in UNITS:
        raise ConfigError(f"--unit {a.unit!r} is not one of {list(UNITS)}")
    if not 0 < a.level < 1:
        raise ConfigError(f"--level={a.level}: an interval level is in (0, 1), e.g. 0.95")
    if a.n_boot < 20:
        raise ConfigError(f"--n-boot={a.n_boot}: use >= 20 replicates for an interval")
    for o in a.overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not key=value")
    if a.topology:
        from rl_jax.plan.chips import canonical_topology, parse_topology

        parse_topology(a.topology)  # a bad name is refused before any fitting
        canonical_topology(a.topology)
    src = a.src
    grid, curves_file, split = _locate(src, a.split)
    rows = _rows(curves_file)
    spec = _spec(grid, rows)
    x = UNITS[a.unit] if a.unit else (spec.report.x if spec else "rollouts")
    metric = a.metric or (spec.report.metric if spec else "val/pass@1")
    rows, split = _split(rows, spec, split)
    res = fit_and_allocate(rows, spec, budget=budget, x=x, metric=metric, a=a)
    res["source"], res["split"] = str(src), split
    plan = _plan_rows(grid, spec)
    res["command"] = _command(res, spec, plan, a)
    if a.topology:
        _price(res, spec, plan, a, rows)
    print(json.dumps(res, indent=2, default=_json) if a.json else format_result(res))
    return 0


def _budget(text: str) -> float:
    try:
        c = float(text)
    except ValueError:
        raise ConfigError(f"--budget {text!r}: give a number of compute units, e.g. 1e6") from None
    if not (math.isfinite(c) and c > 0):
        raise ConfigError(f"--budget {text!r}: must be a finite number > 0")
    return c


def _locate(src: str, split: str | None) -> tuple[str | None, str, str | None]:
    """(grid directory or None, curve file, split implied by the path); paths or bucket
    URLs (a grid written to gs://...)."""
    from rl_jax.runs.storage import is_remote, join

    src = src.rstrip("/") or src
    parent, name = posixpath.split(src) if is_remote(src) else os.path.split(src)
    if name.endswith(CURVE_SUFFIXES) and _has(parent or ".", name):
        return (parent if name == CURVES else None), src, split
    if _has(src, CURVES):
        return src, join(src, CURVES), split
    grid, fits = posixpath.split(parent) if is_remote(src) else os.path.split(parent)
    if fits == "fits" and _has(grid, CURVES):
        if split not in (None, name):
            raise ConfigError(f"--split {split!r} contradicts --from {src} (split {name!r})")
        return grid, join(grid, CURVES), None if name == "all" else name
    raise ConfigError(
        f"--from {src}: not a grid directory (with {CURVES}), a fits/<split> directory of one,"
        " or a curve file (.jsonl, .csv, .parquet)"
    )


def _has(root: str, rel: str) -> bool:
    from rl_jax.runs.storage import open_store

    return open_store(root, key="--from").exists(rel)


def _spec(grid: str | None, rows: list[dict]):
    """The grid's spec (its split axis, recipe, ...) when a spec in experiments/ has its
    name: the rows' `grid` column (a committed study's directory is named otherwise), else
    the grid directory's name. Only bare names are looked up (a spec file runs code)."""
    from rl_jax.grid.spec import load_spec

    names = {str(r["grid"]) for r in rows if r.get("grid")}
    candidates = [*names] if len(names) == 1 else []
    if grid is not None:
        candidates.append(posixpath.basename(grid.rstrip("/")))
    for name in candidates:
        if re.fullmatch(r"[A-Za-z0-9_-]+", name):
            try:
                return load_spec(name)
            except ConfigError:
                continue
    return None


def _rows(path: str) -> list[dict]:
    from rl_jax import scaling

    try:
        return scaling.load_rows(path)
    except scaling.FitError as e:
        raise ConfigError(f"--from {path}: {e}") from None


def _split(rows: list[dict], spec, split: str | None) -> tuple[list[dict], str | None]:
    """The rows of one split (the spec's report.split_by column, else a 'split' column)."""
    col = (spec.report.split_by if spec else "") or "split"
    values = sorted({str(r[col]) for r in rows if r.get(col) is not None})
    if split is None:
        if len(values) > 1:
            raise ConfigError(f"the curves hold splits {values} ({col!r}): pass --split NAME")
        return rows, values[0] if values else None
    if split not in values:
        raise ConfigError(f"--split {split!r}: the curves' {col!r} values are {values}")
    return [r for r in rows if str(r.get(col)) == split], split


def fit_and_allocate(rows, spec, *, budget: float, x: str, metric: str, a) -> dict[str, Any]:
    from rl_jax import scaling

    n_key, bp_key = spec.report.frontier if spec else ("sampling.n", "data.prompts_per_batch")
    try:
        curves = scaling.curves_from_rows(rows, x=x, metric=metric, group_by=None)
        fr = scaling.fit_frontier(curves, n_key=n_key, bp_key=bp_key)
        alloc = scaling.allocate(fr, curves, budget, x=x, n_boot=a.n_boot, level=a.level)
    except scaling.FitError as e:
        raise ConfigError(f"--from {a.src}: {' '.join(str(e).split())}") from None
    return {
        "allocation": alloc,
        "n_key": n_key,
        "bp_key": bp_key,
        "metric": metric,
        "n_values": list(fr.n_values),
        "bp_values": list(fr.bp_values),
        "fit_warnings": list(fr.warnings),
    }


def _plan_rows(grid: str | None, spec) -> dict[str, dict]:
    """run id -> the grid's plan row: its plan.json, else the spec's expansion (a committed
    study keeps curves.jsonl only), {} without either."""
    if grid is not None and _has(grid, "plan.json"):
        from rl_jax.runs.storage import open_store

        runs = json.loads(open_store(grid, key="--from").read_text("plan.json"))["runs"]
        return {r["run_id"]: r for r in runs}
    if spec is None:
        return {}
    from rl_jax.grid.driver import plan_rows
    from rl_jax.grid.expand import expand

    try:
        return {r["run_id"]: r for r in plan_rows(expand(spec))}
    except ConfigError:
        return {}


def _run_overrides(best, plan: dict[str, dict], a) -> tuple[list[str], list[str]]:
    """(the run's overrides: its cell's from plan.json, then the allocation's, then the
    command line's; notes)."""
    notes = []
    row = next((plan[r] for r in best.runs if r in plan), None)
    cell = list(row["overrides"]) if row else []
    if not row:
        notes.append(
            "the grid's other knobs for this cell (its split's, say) are not known (no"
            " plan.json beside the curves, no spec of this grid whose runs they are); add them"
            " as overrides"
        )
    evals = 0
    for o in cell:
        k, v = o.split("=", 1)
        if k == "eval.every" and row and row["steps"]:
            evals = max(1, row["steps"] // max(1, int(v)))
    mine = [f"sampling.n={best.n:g}", f"data.prompts_per_batch={best.bp:g}"]
    if best.steps:
        mine.append(f"train.steps={best.steps}")
        if evals:
            mine.append(f"eval.every={max(1, best.steps // evals)}")
    user_keys = {o.split("=", 1)[0] for o in a.overrides}
    out = [o for o in cell if o.split("=", 1)[0] not in (*SET_KEYS, *user_keys)]
    out += [o for o in mine if o.split("=", 1)[0] not in user_keys]
    return out + list(a.overrides), notes


def _command(res: dict, spec, plan: dict, a) -> dict[str, Any]:
    best = res["allocation"].best
    overrides, notes = _run_overrides(best, plan, a)
    recipe = a.recipe or (spec.recipe if spec else None)
    if recipe is None:
        notes.append("the grid's recipe is not known: pass --recipe")
        return {"recipe": None, "overrides": overrides, "argv": None, "notes": notes}
    from rl_jax.config import load_recipe
    from rl_jax.grid.backends import host_train_cmd

    head = (
        host_train_cmd(spec.warm_start, spec.warm_start_overrides) if spec else ["rl-jax", "train"]
    )

    load_recipe(recipe, overrides)  # the printed command must resolve: an unknown key is exit 2
    argv = [*head, recipe, *overrides]
    return {"recipe": recipe, "overrides": overrides, "argv": argv, "notes": notes}


def _rollouts_per_unit(rows: list[dict], runs, x: str) -> float:
    """Rollouts per unit of C in a cell (1 for rollouts), from its last curve row."""
    if x == "rollouts":
        return 1.0
    last = [r for r in rows if r.get("run_id") in runs and r.get(x) and r.get("rollouts")]
    if not last:
        return math.nan
    r = max(last, key=lambda r: float(r[x]))
    return float(r["rollouts"]) / float(r[x])


def _price(res: dict, spec, plan: dict, a, rows: list[dict]) -> None:
    """Each candidate's rollouts per hour and chip-hours for C on the topology (the plan's
    estimate), and the chosen one's mesh in the command."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # planning for a TPU needs none here
    from rl_jax.config import load_recipe
    from rl_jax.plan.chips import canonical_topology

    cmd = res["command"]
    if cmd["recipe"] is None:
        raise ConfigError("--topology prices the grid's recipe, which is not known: pass --recipe")
    alloc, prices = res["allocation"], []
    for cand in alloc.candidates:
        over, _ = _run_overrides(cand, plan, a)
        cfg = load_recipe(cmd["recipe"], over)
        rollouts = alloc.budget * _rollouts_per_unit(rows, cand.runs, alloc.x)
        topology = canonical_topology(a.topology)
        prices.append(_candidate_price(cand, cfg, topology, rollouts, alloc.x))
    res["topology"], res["prices"] = a.topology, prices
    if not cfg.sampling.max_prompt_len:
        # The estimate then counts no prompt tokens, and the compiled plan refuses the run.
        res["command"].setdefault("notes", []).append(
            "the recipe leaves sampling.max_prompt_len to the data (0): priced without prompt"
            " tokens, and `rl-jax plan` needs it; add sampling.max_prompt_len=... to both"
        )
    if prices[0]["fits"] and cmd["argv"]:
        _add_mesh(cmd, prices[0], a.topology)


def _candidate_price(cand, cfg, topology: str, rollouts: float, x: str) -> dict:
    """One candidate's row: its best estimated mesh's rollouts per hour and the (chip-)hours
    its `rollouts` take, or why it has none (fits: None) or that nothing fits (False)."""
    from rl_jax.plan import search

    found = search(
        cfg, topology, top=1, estimate_only=True, budget_rollouts=rollouts if rollouts > 0 else 1.0
    )
    ranked = found["ranked"]
    if not math.isfinite(rollouts):
        why = f"no rollouts column beside {x} to convert C into rollouts"
        return {"n": cand.n, "bp": cand.bp, "fits": None, "why": why}
    if not ranked:
        return {"n": cand.n, "bp": cand.bp, "fits": False}
    r = ranked[0]
    hours = rollouts / r["rollouts_per_hour"]
    return {
        "n": cand.n,
        "bp": cand.bp,
        "fits": True,
        "rollouts_per_hour": r["rollouts_per_hour"],
        "hours": hours,
        "chip_hours": hours * found["chips"],
        "mesh_overrides": r["overrides"],
        "rollouts": rollouts,
    }


def _add_mesh(cmd: dict, chosen: dict, topology: str) -> None:
    """The chosen candidate's mesh overrides into the training command (in place of the
    same keys), and the `rl-jax plan` command that compiles it."""
    keys = {o.split("=", 1)[0] for o in chosen["mesh_overrides"]}
    cmd["argv"] = [o for o in cmd["argv"] if o.split("=", 1)[0] not in keys]
    cmd["argv"] += chosen["mesh_overrides"]
    plan_over = cmd["argv"][cmd["argv"].index(cmd["recipe"]) + 1 :]
    cmd["plan_argv"] = ["rl-jax", "plan", cmd["recipe"], *plan_over, "--topology", topology]
    cmd["plan_argv"] += ["--budget-rollouts", f"{chosen['rollouts']:.6g}"]


def _json(v):
    if hasattr(v, "to_dict"):
        return v.to_dict()
    return str(v)


def _f(v: float) -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _vals(vs) -> str:
    return "{" + ", ".join(f"{v:g}" for v in vs) + "}"


def format_result(res: dict) -> str:
    al = res["allocation"]
    b = al.best
    split = f", split {res['split']}" if res["split"] else ""
    trend = al.n_star_trend
    lines = [
        f"frontier of {res['source']}{split}: {res['n_key']} in {_vals(res['n_values'])},"
        f" {res['bp_key']} in {_vals(res['bp_values'])}; {res['metric']} fitted over"
        f" {_f(al.fitted[0])} .. {_f(al.fitted[1])} {al.x}",
        *al.notes,
        f"budget C = {al.budget:.6g} {al.x}: n = {b.n:g}, B_p = {b.bp:g}, M ="
        f" {b.steps if b.steps is not None else 'unknown'} steps; frontier {res['metric']} at C ="
        f" {al.reward:.4f} ({al.level:.0%} interval {al.interval[0]:.4f} .. {al.interval[1]:.4f};"
        f" one new run's evaluation: {al.predictive[0]:.4f} .. {al.predictive[1]:.4f})",
        f"P(n* = {b.n:g}) = {b.p_best:.2f} over the bootstrap"
        + ("" if trend is None else f"; the fitted n*(C) trend at C: {trend:.3g}"),
    ]
    prices = {(p["n"], p["bp"]): p for p in res.get("prices", [])}
    head = f"{'n':>6} {'B_p':>6} {'M':>8} {'reward':>7} {'interval':>17} {'P(n*)':>6}"
    if prices:
        head += f" {'rollouts/h':>11} {'hours':>8} {'chip-h':>8}"
    lines += ["candidates (each n with its best B_p at C):", head]
    for c in al.candidates:
        line = (
            f"{c.n:>6g} {c.bp:>6g} {c.steps if c.steps is not None else '-':>8} {c.reward:>7.4f}"
            f" {f'[{c.interval[0]:.3f}, {c.interval[1]:.3f}]':>17} {c.p_best:>6.2f}"
        )
        p = prices.get((c.n, c.bp))
        if p is not None:
            line += (
                f" {_f(p['rollouts_per_hour']):>11} {_f(p['hours']):>8} {_f(p['chip_hours']):>8}"
                if p["fits"]
                else f"  not priced: {p['why']}"
                if p["fits"] is None
                else f"  does not fit on {res['topology']}"
            )
        lines.append(line)
    if prices:
        lines.append(
            f"(prices: `rl-jax plan --search --estimate-only` on {res['topology']}, its best"
            " layout per candidate; the compiled plan decides)"
        )
    cmd = res["command"]
    lines += cmd.get("notes", [])
    if cmd["argv"]:
        lines.append("run: " + shlex.join(cmd["argv"]))
    if cmd.get("plan_argv"):
        lines.append("plan it (compiled): " + shlex.join(cmd["plan_argv"]))
    lines += [f"warning: {w}" for w in res["fit_warnings"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
