"""`rl-jax eval RUN [--step N] [key=value ...]`: validation metrics of a run's checkpoint.

    rl-jax eval runs/scalerl                       # newest checkpoint, the run's eval settings
    rl-jax eval runs/scalerl/checkpoints/40 eval.k=64 eval.num_prompts=256
    rl-jax eval runs/scalerl --step 40 --json > step40.json

The policy is sampled on the run's validation split with the run's sampling, eval
and reward settings (overrides apply on top), the same key as the trainer's own
evaluations, so the default settings reproduce the run's curve row at that step.
Prints the metrics (val/pass@1 = mean@k, val/best@k, val/worst@k, per
difficulty, response length, truncation rate); with --json one JSON object that
also holds run_id, step, version, the checkpoint, the eval settings and the run's
compute counters at that step (a curve point for a larger k or more prompts).
The run directory is only read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from rl_jax.cli import raw_parser
from rl_jax.knobs import ConfigError

# Overrides that would change the policy or the data it was trained on, not how it
# is evaluated: refused, so a curve row never mixes two experiments.
_FIXED = ("model.", "train.", "loss.")


def build_parser() -> argparse.ArgumentParser:
    p = raw_parser("rl-jax eval", *__doc__.split("\n\n", 1))
    p.add_argument("run", help="run directory, RUN/checkpoints or RUN/checkpoints/STEP")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="eval.*, sampling.*, data.*, rewards.*, mesh.* overrides",
    )
    return p


def _eval_mesh(mesh_cfg):
    """The run's mesh on this machine if it fits; else data parallel over every device
    (the sampler's rows do not depend on the layout)."""
    from rl_jax.sharding import make_mesh

    one_process = dataclasses.replace(mesh_cfg, distributed=False, sampler_devices=0)
    try:
        return make_mesh(one_process)
    except ConfigError:
        return make_mesh(dataclasses.replace(one_process, data=-1, fsdp=1, tensor=1))


def main(argv: list[str]) -> int:
    args = build_parser().parse_intermixed_args(argv)
    from rl_jax.config import run_id

    ck, cfg = _checkpoint_and_config(args)
    from rl_jax.sharding import start_jax

    start_jax(dataclasses.replace(cfg.mesh, distributed=False))
    import jax

    from rl_jax.train.evaluation import (
        correctness_fn,
        eval_key,
        evaluate_policy,
        make_eval_sampler,
    )
    from rl_jax.train.policy_io import load_verified_params, run_spec, run_tokenizer, verified_meta
    from rl_jax.train.preflight import task_and_prompt_len

    t0 = time.perf_counter()
    mesh = _eval_mesh(cfg.mesh)
    spec = run_spec(ck)
    params, ck = load_verified_params(
        ck, spec, mesh=mesh, rules_preset=cfg.mesh.rules, purpose="sample"
    )
    meta = verified_meta(ck)
    tok = run_tokenizer(ck)
    # Rendered as in training: chat template, answer instruction.
    task, prompt_len = task_and_prompt_len(cfg, tok)
    problems = list(task.val)[: cfg.eval.num_prompts]
    if not problems:
        raise ConfigError(
            f"data.source={cfg.data.source!r} has no validation problems (data.val_size)"
        )
    sampler = make_eval_sampler(
        spec, cfg, tok, mesh=mesh, prompt_len=prompt_len, problems=len(problems)
    )
    version = int(meta.get("version", ck.step))
    metrics, _ = evaluate_policy(
        sampler,
        params,
        problems,
        tokenizer=tok,
        correct_fn=correctness_fn(cfg.rewards, task),
        k=cfg.eval.k,
        key=eval_key(cfg.train.seed),
        version=version,
    )
    metrics["time/eval_s"] = time.perf_counter() - t0
    out = {
        "run_id": run_id(ck.cfg),
        "step": ck.step,
        "version": version,
        "checkpoint": str(ck.step_dir),
        "devices": jax.device_count(),
        **metrics,
    }
    _print(out, metrics, cfg, meta, as_json=args.json)
    return 0


def _checkpoint_and_config(args):
    """(the run's checkpoint, the run's config with the overrides eval may change),
    checked before any device work."""
    from rl_jax.config import apply_overrides
    from rl_jax.train.policy_io import find_run_checkpoint
    from rl_jax.train.preflight import check_data_files

    ck = find_run_checkpoint(args.run, args.step)
    bad = [o for o in args.overrides if o.split("=", 1)[0].startswith(_FIXED)]
    if bad:
        raise ConfigError(
            f"{bad}: eval keeps the run's model.*, train.* and loss.* (they define the policy)"
        )
    cfg = apply_overrides(ck.cfg, args.overrides)
    check_data_files(cfg.data)
    return ck, cfg


def _print(out: dict, metrics: dict, cfg, meta: dict, *, as_json: bool) -> None:
    if as_json:
        out["eval"] = {f"eval.{k}": v for k, v in dataclasses.asdict(cfg.eval).items()}
        out["counters"] = meta.get("counters", {})
        print(json.dumps(out))
    else:
        print(f"run {out['run_id']} step {out['step']} ({out['checkpoint']})")
        for k, v in metrics.items():
            print(f"  {k:<28} {v:.4f}")
    sys.stdout.flush()
