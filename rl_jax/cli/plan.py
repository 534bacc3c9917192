"""`rl-jax plan RECIPE [key=value ...] --topology NAME`: compile a run's programs for a
TPU topology from this host and print per-chip HBM, FLOPs and a roofline time."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rl_jax.config import describe_knobs, load_recipe
from rl_jax.plan.chips import parse_topology


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="rl-jax plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog="knobs:\n" + describe_knobs(),
    )
    p.add_argument("recipe", help="recipe file or name in experiments/ (e.g. scalerl)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--topology", required=True, help="TPU topology, e.g. v5e:2x2, v5p:4x4x4")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--out", default=None, help="also write DIR/plan.json")
    a = p.parse_intermixed_args(argv)
    cfg = load_recipe(a.recipe, a.overrides)
    parse_topology(a.topology)  # a bad name is refused before JAX starts
    # Compiling for TPU needs no TPU, but JAX must not claim one as its default backend.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see plan.topology_devices

    from rl_jax.plan import plan_run

    plan = plan_run(cfg, a.topology)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    print(json.dumps(plan) if a.json else format_plan(plan))
    return 0


def format_plan(plan: dict) -> str:
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    lines = [
        f"{plan['topology']}: {plan['chips']} chips, {plan['hbm_capacity_gb']:.1f} GB HBM each;"
        f" mesh {mesh}; model {plan['model']['params'] / 1e9:.3g}B params",
        f"{'program':<12} {'HBM GB':>8} {'args':>8} {'temp':>8} {'fits':>5} "
        f"{'GFLOP':>10} {'useful':>7} {'roofline s':>11} {'MFU':>6}",
    ]
    for r in plan["programs"]:
        lines.append(
            f"{r['name']:<12} {r['hbm_total_gb']:>8.2f} {r['hbm_gb']['arguments']:>8.2f} "
            f"{r['hbm_gb']['temporaries']:>8.2f} {'yes' if r['fits'] else 'NO':>5} "
            f"{r['flops'] / 1e9:>10.1f} {1 / r['flops_ratio']:>7.2f} {r['roofline_s']:>11.4f} "
            f"{r['mfu_estimate']:>6.2f}"
        )
    lines.append("(per chip; useful = analytic model FLOPs / compiled FLOPs)")
    return "\n".join(lines)
