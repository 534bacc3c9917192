"""What a plan assumes, said before its numbers: where the model's shapes come from, the
batch and lengths every number is for, and what its budget hours are hours of.

A plan needs the model's shapes, not its weights: a recipe that names a checkpoint
(`model.path`) is planned from that checkpoint's config where this host has it, and
from the recipe's preset (`model.preset`) where it does not (a plan is typically made
on a workstation before the checkpoint is copied to the TPU hosts).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rl_jax.config import ModelConfig, RunConfig, paths
from rl_jax.knobs import ConfigError
from rl_jax.models.load import base_fields, resolve_spec

# ScaleRL's 8B run: 7,400 steps of 48 prompts x 16 samples for 100,000 GPU-hours
# (arXiv 2510.13786, Figure 1); the budget a plan converts into hours on its topology.
SCALERL_STEPS, SCALERL_ROLLOUTS_PER_STEP = 7400, 48 * 16
SCALERL_BUDGET_ROLLOUTS = SCALERL_STEPS * SCALERL_ROLLOUTS_PER_STEP
# That run's shapes (experiments/scalerl_8b.py): the budget's hours are its cost only
# for a run of these.
SCALERL_SHAPES = {"preset": "qwen3-8b", "prompts": 48, "samples": 16, "prompt": 1024, "new": 14336}


def planned_model(cfg: RunConfig) -> tuple[RunConfig, str]:
    """(`cfg` with the model a plan compiles, one line naming where its shapes come from).

    `model.path` absent from this host (a local path with nothing there, a URL with no
    object): the preset's shapes, `model.path` cleared, and the line says so; with no
    preset to fall back on, a ConfigError. A path that is there but is no model is the
    loader's error, as for a run."""
    m = cfg.model
    if m.path and paths.kind(m.path, "model.path") is None:
        if not m.preset:
            raise ConfigError(
                f"model.path={m.path!r} is not on this machine and model.preset='' gives no "
                "shapes to plan: give the checkpoint's preset (model.preset=NAME) or the "
                "local path of its config.json"
            )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, path=""))
        return cfg, (
            f"model: the shapes of preset {m.preset!r} (model.path={m.path!r} is not on this "
            "machine; a checkpoint of other shapes plans differently)"
        )
    return cfg, f"model: {base_fields(m)[1]}"


def model_facts(cfg: RunConfig, source: str) -> dict[str, Any]:
    """What a plan assumes of the model: where the shapes come from (`source`, the line of
    `planned_model`), the preset, parameters, layers, remat and dtypes."""
    spec = resolve_spec(cfg.model)
    return {
        "source": source,
        "preset": cfg.model.preset,
        "path": cfg.model.path,
        "params": spec.num_params(),
        "layers": spec.num_layers,
        "remat": spec.remat,
        "param_dtype": spec.param_dtype,
        "compute_dtype": spec.compute_dtype,
    }


def shapes(cfg: RunConfig, source: str, budget_rollouts: float) -> dict[str, Any]:
    """The shapes every number of a plan or a search is for: the model (`model_facts`),
    prompts x samples per batch, prompt + new tokens, and what the budget's hours mean."""
    sc = cfg.sampling
    return {
        "model": model_facts(cfg, source),
        "prompts": cfg.data.prompts_per_batch,
        "samples": sc.n,
        "prompt_tokens": sc.max_prompt_len,
        "new_tokens": sc.max_new_tokens,
        "budget": budget_note(cfg, budget_rollouts),
    }


def budget_note(cfg: RunConfig, budget_rollouts: float) -> str:
    """What a plan's budget hours are: `budget_rollouts` rollouts of this run's shapes at
    its rate; the ScaleRL default is that paper's cost only at that paper's shapes."""
    if budget_rollouts != SCALERL_BUDGET_ROLLOUTS:
        return f"budget h: {budget_rollouts:.4g} rollouts (--budget-rollouts) of these shapes"
    note = (
        f"budget h: ScaleRL's 8B budget, {SCALERL_BUDGET_ROLLOUTS / 1e6:.2f} M rollouts"
        f" ({SCALERL_STEPS:,} steps of {SCALERL_ROLLOUTS_PER_STEP}), of these shapes"
    )
    if _scalerl_shapes(cfg):
        return note + " (ScaleRL's own: the hours are that run's)"
    s = SCALERL_SHAPES
    return note + (
        f"; NOT ScaleRL's shapes (Qwen3-8B, {s['prompts']} x {s['samples']},"
        f" {s['prompt']:,} + {s['new']:,} tokens), so not that run's hours:"
        " `rl-jax plan scalerl_8b` plans those"
    )


def _scalerl_shapes(cfg: RunConfig) -> bool:
    s, sc = SCALERL_SHAPES, cfg.sampling
    paper = resolve_spec(ModelConfig(preset=s["preset"]))
    spec = resolve_spec(cfg.model)
    return (cfg.data.prompts_per_batch, sc.n, sc.max_prompt_len, sc.max_new_tokens) == (
        s["prompts"],
        s["samples"],
        s["prompt"],
        s["new"],
    ) and (spec.num_params(), spec.num_layers) == (paper.num_params(), paper.num_layers)
