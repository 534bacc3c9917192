"""`rl-jax plan RECIPE [key=value ...] --topology NAME [--search]`: compile a run's
programs (train step, log-prob pass, the engine's prefill_insert and generate) for a
TPU topology from this host and print per-chip HBM (a program fits with 10% of the chip
free; one that does not says by how much and what to try), FLOPs and roofline times,
the RL step's rollouts per hour and the hours ScaleRL's 8B budget of rollouts takes at
these shapes. A model.path this host lacks is planned with model.preset's shapes.
Split mode (mesh.sampler_devices=N) compiles the engine's programs on the first N
chips and the trainer's on the rest; its step is the slower side plus the weight push.
--search ranks mesh shapes, remat, micro-batches, PipelineRL's batches in flight (W,
train.pipeline_waves), the engine's slots (sampling.engine_slots) and split mode by
rollouts per hour, compiling down a closed-form estimate's ranking until --top fit;
each row with the command that plans it. --estimate-only: the estimate alone,
compiling nothing."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from pathlib import Path

from rl_jax.cli import raw_parser
from rl_jax.config import load_recipe
from rl_jax.config.paths import check_dir_path
from rl_jax.knobs import ConfigError
from rl_jax.plan.chips import canonical_topology, parse_topology


def build_parser() -> argparse.ArgumentParser:
    p = raw_parser("rl-jax plan", __doc__, knobs=True)
    p.add_argument("recipe", help="recipe file or name in experiments/ (e.g. scalerl)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument(
        "--topology",
        required=True,
        help="TPU topology: <chip>:<shape> (v5e:2x2, v5p:4x4x4) or a Cloud TPU"
        " accelerator type (v5p-128, v6e-64, v5litepod-16)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--out", default=None, help="also write DIR/plan.json")
    p.add_argument(
        "--search", action="store_true", help="rank the configurations that fit (see plan._search)"
    )
    p.add_argument(
        "--top",
        type=int,
        default=3,
        help="--search: candidates that fit to find: compiles down the estimate's ranking"
        " until this many fit or all are tried (with --estimate-only: estimates shown)",
    )
    p.add_argument(
        "--estimate-only",
        action="store_true",
        help="--search: compile nothing; rank the --top best closed-form estimates that fit"
        " (seconds; the compiled plan decides)",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="compile only the run's programs (HBM per chip, fits), not the programs that "
        "count FLOPs (most of a plan's compiles): no FLOPs, roofline, MFU or hours",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="programs compiled at once (threads; each compile of a large model can "
        "take several GB of host RAM)",
    )
    p.add_argument(
        "--budget-rollouts",
        type=float,
        default=None,
        help="rollouts of the budget to convert into hours (default: ScaleRL's 8B run)",
    )
    return p


def _check_options(a: argparse.Namespace) -> None:
    if a.top < 1:
        raise ConfigError(f"--top={a.top}: compile at least one candidate (>= 1)")
    if a.memory_only and a.search:
        raise ConfigError(
            "--memory-only with --search: the search ranks by rollouts per hour, which needs "
            "the FLOPs --memory-only skips; drop one of them"
        )
    if a.estimate_only and not a.search:
        raise ConfigError("--estimate-only ranks the search's estimates: add --search")
    if a.jobs < 1:
        raise ConfigError(f"--jobs={a.jobs}: compile at least one program at a time (>= 1)")
    if a.budget_rollouts is not None and not a.budget_rollouts > 0:
        raise ConfigError(f"--budget-rollouts={a.budget_rollouts}: must be > 0")


def main(argv: list[str]) -> int:
    a = build_parser().parse_intermixed_args(argv)
    cfg = load_recipe(a.recipe, a.overrides)
    parse_topology(a.topology)  # a bad name is refused before JAX starts
    given_topology, a.topology = a.topology, canonical_topology(a.topology)
    _check_options(a)
    if a.out:
        check_dir_path(a.out, "--out")
    # Compiling for TPU needs no TPU, but JAX must not claim one as its default backend.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see plan.topology_devices

    import jax

    from rl_jax.plan import SCALERL_BUDGET_ROLLOUTS, compile_jobs, plan_run, search

    # An executable for a topology this host lacks cannot be loaded back from the
    # persistent cache (it needs the TPU client), so a plan neither writes nor reads it.
    jax.config.update("jax_enable_compilation_cache", False)

    budget = a.budget_rollouts or SCALERL_BUDGET_ROLLOUTS
    with compile_jobs(a.jobs):
        if a.search:
            plan = search(
                cfg,
                a.topology,
                top=a.top,
                budget_rollouts=budget,
                estimate_only=a.estimate_only,
                progress=lambda line: print(f"rl-jax plan: {line}", file=sys.stderr, flush=True),
            )
            for row in plan["ranked"] + [e for e in plan["excluded"] if e["reason"] == "compiled"]:
                row["command"] = command(a.recipe, a.overrides, row["overrides"], given_topology)
            text = format_search
        else:
            plan = plan_run(cfg, a.topology, budget_rollouts=budget, count_flops=not a.memory_only)
            text = format_plan
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        name = "search.json" if a.search else "plan.json"
        (Path(a.out) / name).write_text(to_json(plan, indent=2) + "\n")
    print(to_json(plan) if a.json else text(plan))
    return 0


def command(recipe: str, given: list[str], row: list[str], topology: str) -> str:
    """The `rl-jax plan` command of a search's row: the recipe, the overrides it was given
    (less those the row sets) and the row's, as one shell line."""
    keys = {o.split("=", 1)[0] for o in row}
    kept = [o for o in given if o.split("=", 1)[0].strip() not in keys]
    return shlex.join(["rl-jax", "plan", recipe, *kept, *row, "--topology", topology])


def to_json(tree, indent: int | None = None) -> str:
    """Strict JSON: a value with no number (NaN, infinity: a program that does not
    compile, a rate of nothing) is null."""
    return json.dumps(_finite(tree), indent=indent, allow_nan=False)


def _finite(x):
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _axes(axes: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in axes.items())


def format_plan(plan: dict) -> str:
    mesh = _axes(plan["mesh"])
    if "sampler_mesh" in plan:  # split mode: the engine's programs on chips of their own
        mesh = f"trainer {mesh}, sampler {_axes(plan['sampler_mesh'])}"
    b, st, bud, m = plan["batch"], plan["step"], plan["budget"], plan["model"]
    lines = [
        m["source"],
        f"{plan['topology']}: {plan['chips']} chips, {plan['hbm_capacity_gb']:.1f} GB HBM each;"
        f" a program fits under {plan['fit_limit_gb']:.1f} GB ({plan['headroom']:.0%} headroom)"
        f"; mesh {mesh}",
        f"{_model(m)}; batch {b['prompts']} prompts x {b['samples']} samples,"
        f" {b['updates']} minibatches (grad_accum {b['grad_accum']}),"
        f" {b['prompt_len']}+{b['gen_len']} tokens; " + _sampler_line(plan),
        f"{'program':<14} {'HBM GB':>7} {'args':>7} {'temp':>7} {'other':>7} {'fits':>4} "
        f"{'GFLOP':>9} {'useful':>6} {'x exp':>5} {'roofline s':>10} {'ICI s':>9} {'MFU':>5}"
        f" {'calls':>7}",
    ]
    for r in plan["programs"]:
        g = r["hbm_gb"]
        if "error" in r:  # XLA refused it: more HBM than the chip has
            lines.append(f"{r['name']:<14} {r['hbm_total_gb']:>7.2f}  does not fit: {r['error']}")
            continue
        lines.append(
            f"{r['name']:<14} {r['hbm_total_gb']:>7.2f} {g['arguments']:>7.2f} "
            f"{g['temporaries']:>7.2f} {g['resident']:>7.2f} {'yes' if r['fits'] else 'NO':>4} "
            f"{r['flops'] / 1e9:>9.1f} {_useful(r):>6.2f} {r['flops_expected_ratio']:>5.2f}"
            f" {r['roofline_s']:>10.4g} {r['collective_s']:>9.3g} "
            f"{r['mfu_estimate']:>5.2f} {r['calls']:>7.4g}"
        )
    lines += [
        "(per chip; other = buffers live beside the program: optimizer state, the"
        " stream's engine state; useful = model FLOPs / compiled FLOPs; x exp ="
        " compiled / (model + what remat, blockwise attention and the chunked LM head"
        " recompute); ICI s = the collectives' bytes over one torus axis's links;"
        " decode's and generate's row is one token per row or slot)",
        *(["DOES NOT FIT:"] + [f"  {a}" for a in plan["advice"]] if plan["advice"] else []),
    ]
    for r in plan["programs"]:
        if r.get("bytes_floor_ratio") is not None:
            lines.append(
                f"{r['name']}: reads {r['bytes_analytic'] / 1e9:.3g} GB a step per chip,"
                f" {r['bytes_floor_ratio']:.2f}x the floor ({r['bytes_floor'] / 1e9:.3g} GB:"
                " the weights and the cache positions a step attends)"
            )
    if plan["flops_counted"]:
        lines += [
            f"RL step: {st['roofline_s']:.4g} s roofline, MFU {st['mfu_estimate']:.2f},"
            f" {st['rollouts_per_hour']:.4g} rollouts/hour; {bud['rollouts']:.4g} rollouts"
            f" in {bud['hours']:.4g} h = {bud['chip_hours']:.4g} chip-hours",
            f"with collectives, none overlapped: {st['roofline_s_with_collectives']:.4g} s,"
            f" {st['rollouts_per_hour_with_collectives']:.4g} rollouts/hour",
            *([_split_line(st["split"])] if "split" in st else []),
            bud["note"],
        ]
    else:
        why = "--memory-only" if plan["fits"] else "a program does not fit"
        lines.append(f"RL step: FLOPs not counted ({why}): no roofline, MFU or hours")
    return "\n".join(lines)


def _split_line(sp: dict) -> str:
    return (
        f"split: the trainer's programs {sp['trainer_s']:.4g} s and the sampler's"
        f" {sp['sampler_s']:.4g} s run at once; the step is the slower plus the weight push"
        f" ({sp['push_gb']:.3g} GB per sampler chip, {sp['push_s']:.3g} s)"
    )


def _model(m: dict) -> str:
    return (
        f"model {m['params'] / 1e9:.3g}B params, {m['layers']} layers, remat {m['remat']},"
        f" params {m['param_dtype']} / compute {m['compute_dtype']}"
    )


def _sampler_line(plan: dict) -> str:
    b, e = plan["batch"], plan["engine"]
    stream = (
        f" (PipelineRL's stream: {b['batches_in_flight']} batches untrained at once)"
        if b["batches_in_flight"] > 1
        else ""
    )
    return (
        f"sampler: the engine, {e['slots']} slots{stream}, chunks of {e['chunk']} steps,"
        f" {e['prefill_prompts']} prompts a prefill; KV cache {plan['kv_cache_gb']:.2f}"
        " GB/chip (its slots)"
    )


def _useful(r: dict) -> float:
    """Model FLOPs / compiled FLOPs (NaN where XLA counted none)."""
    return r["flops_analytic"] / r["flops"] if r["flops"] else float("nan")


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _search_header(res: dict) -> list[str]:
    estimated, sh = res["estimate_only"], res["shapes"]
    prompt = (
        f"{sh['prompt_tokens']} prompt"
        if sh["prompt_tokens"]
        else "no prompt (sampling.max_prompt_len=0)"
    )
    return [
        f"shapes of every row: {sh['model']['source']}; {_model(sh['model'])}; batch"
        f" {sh['prompts']} prompts x {sh['samples']} samples; {prompt} +"
        f" {sh['new_tokens']} new tokens",
        sh["budget"],
        f"{res['topology']}: {res['candidates']} candidates, {res['passed_estimate']} within"
        f" {res['fit_limit_gb'] if estimated else res['hbm_capacity_gb']:.1f} GB per chip by"
        f" the memory estimate; a program fits under {res['fit_limit_gb']:.1f} GB of"
        f" {res['hbm_capacity_gb']:.1f} ({res['headroom']:.0%} headroom)",
    ]


def format_search(res: dict) -> str:
    estimated = res["estimate_only"]
    compiled = [e for e in res["excluded"] if e["reason"] == "compiled"]
    lines = _search_header(res)
    if estimated:
        lines.append(
            f"estimate only, nothing compiled: the {len(res['ranked'])} best estimates that fit"
            " (est GB; the compiled plan decides)"
        )
    else:
        lines.append(
            f"compiled {res['compiled']} in the estimate's order until {res['top']} fit"
            f" (--top): {len(res['ranked'])} fit, {len(compiled)} did not"
            + ("" if len(res["ranked"]) == res["top"] else "; every candidate was tried")
        )
    lines.append(
        f"{'rank':>4} {'smp':>4} {'data':>4} {'fsdp':>4} {'tp':>3} {'remat':>9} {'micro':>5}"
        f" {'waves':>5} {'slots':>6} {'HBM GB':>7} {'est GB':>7} {'rollouts/h':>11} {'MFU':>5}"
        f" {'budget h':>9}"
    )
    for i, r in enumerate(res["ranked"], 1):
        m = r["mesh"]
        lines += [
            f"{i:>4} {r['sampler'] or '-':>4} {m['data']:>4} {m['fsdp']:>4} {m['tensor']:>3}"
            f" {r['remat']:>9} {r['micro']:>5} {r['waves'] or '-':>5}"
            f" {r['slots'] or 'recipe':>6} {_gb(r['hbm_gb']):>7}"
            f" {r['hbm_estimate_gb']:>7.2f} {r['rollouts_per_hour']:>11.4g}"
            f" {r['mfu_estimate']:>5.2f} {r['budget_hours']:>9.4g}",
            f"     {r.get('command') or ' '.join(r['overrides'])}",
        ]
    if not res["ranked"]:
        lines.append(
            "no candidate fits: a larger slice, shorter lengths or a smaller batch"
            " (what the run learns) are left"
        )
    if compiled:
        lines.append("compiled and did not fit (per chip; estimate beside it):")
        lines += [
            f"  {e['hbm_gb']:.2f} GB (est {e['hbm_estimate_gb']:.2f}):"
            f" {e.get('command') or ' '.join(e['overrides'])}"
            for e in compiled
        ]
    lines.append(
        f"excluded: {sum(e['reason'] == 'estimate' for e in res['excluded'])} by the memory"
        f" estimate, {len(compiled)} after compiling (smp: split mode's sampler chips,"
        " mesh.sampler_devices; the mesh is the trainer's, on the other chips)"
    )
    return "\n".join(lines)
