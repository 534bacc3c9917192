"""Compute accounting: every counter a curve can be fitted against (DESIGN.md), and the
one count of an RL step's FLOPs that runs, grids and plans share.

FLOPs are model FLOPs (`ModelSpec.flops_per_token`: 2 per multiply-add through the
weights, 4 * H * hd per attended key and layer; causal attention counted once,
rematerialization not counted). A batch of P prompt groups of G samples:

* a forward pass over it runs each prompt once (the sampler prefills a prompt once
  for its G samples; the trainer runs it once per group) and each completion token
  j (0-based) attending to its prompt's tp tokens and j + 1 of its own;
* sampling costs one forward pass; training costs a forward and a backward
  (backward = 2 forwards) over the batch, whatever the number of minibatches, plus
  one forward for each of the old policy's log-probs, the reference's log-probs
  and the critic's values that the recipe needs (`extra_forwards`).

This module imports neither JAX nor the model code: the grid driver plans with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rl_jax.config import RunConfig

TRAIN_PASSES = 3.0  # forward + backward, in forward passes


@dataclass
class ComputeCounters:
    """Cumulative counters."""

    rollouts: int = 0  # completed sampled rows used for training
    prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    sampler_flops: float = 0.0
    trainer_flops: float = 0.0
    eval_flops: float = 0.0
    device_seconds: float = 0.0  # wall seconds x devices, training work only
    eval_device_seconds: float = 0.0

    @property
    def flops(self) -> float:
        """Training compute (sampler + trainer); evaluation is accounted separately."""
        return self.sampler_flops + self.trainer_flops

    def add(self, **inc) -> None:
        for k, v in inc.items():
            if not hasattr(self, k):
                raise KeyError(f"unknown compute counter {k!r}")
            setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["flops"] = self.flops
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ComputeCounters:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def forward_flops(
    spec: Any,
    prompt_lens_p: Sequence[float],
    completion_lens_b: Sequence[float],
    samples_per_prompt: int,
) -> float:
    """Model FLOPs of one forward pass over P prompt groups of G completions.

    prompt_lens_p: [P] prompt tokens; completion_lens_b: [P * G] completion tokens,
    group by group; spec: a ModelSpec (anything with `flops_per_token`)."""
    tp = np.asarray(prompt_lens_p, np.float64)
    g = np.asarray(completion_lens_b, np.float64)
    G = int(samples_per_prompt)
    if g.size != tp.size * G:
        raise ValueError(f"{g.size} completion lengths for {tp.size} prompts x {G} samples")
    dense = spec.flops_per_token(0)
    per_key = spec.flops_per_token(1) - dense  # attention FLOPs per attended key
    prompts = np.sum(tp * dense + per_key * tp * (tp + 1) / 2)
    tp_b = np.repeat(tp, G)
    completions = np.sum(g * dense + per_key * g * (tp_b + (g + 1) / 2))
    return float(prompts + completions)


@dataclass(frozen=True)
class Passes:
    """The forward passes over a whole batch that training takes besides its updates,
    as the trainer runs them and the plan compiles and counts them."""

    old: bool  # the old policy's log-probs: the policy steps within the batch, TIS, KL reward
    keep_old: bool  # ... kept in the batch for the loss (the first two)
    ref: bool  # the reference's log-probs (a KL term)
    critic: bool  # the critic's values (GAE)

    @property
    def count(self) -> int:
        return int(self.old) + int(self.ref) + int(self.critic)

    @property
    def calls(self) -> dict[str, int]:
        """{program: calls per RL step} of the passes taken: "logprob" once for the old
        policy and once for the reference, "values" once (the critic)."""
        out = {"logprob": int(self.old) + int(self.ref), "values": int(self.critic)}
        return {name: n for name, n in out.items() if n}


def passes(cfg: RunConfig) -> Passes:
    """The recipe's `Passes`."""
    loss = cfg.loss.resolved()
    kl = loss.kl_coef > 0
    keep = policy_steps(cfg) > 1 or loss.tis
    return Passes(
        old=keep or (kl and loss.kl_in_reward),
        keep_old=keep,
        ref=kl,
        critic=loss.advantage == "gae",
    )


def extra_forwards(cfg: RunConfig) -> int:
    """Forward passes over a whole batch that training takes besides its updates
    (`passes`): the old policy's log-probs, the reference's and the critic's values."""
    return passes(cfg).count


def policy_steps(cfg: RunConfig) -> int:
    """Optimizer steps a batch's M minibatch updates take, as PipelineRL's k counts them
    (steps of the trainer, not gradient micro-batches) and as the old policy's log-probs
    need them (the policy changes within the batch only if this is above 1):
    M / train.grad_accum where grad_accum divides M (each batch starts a fresh
    accumulation, `version` counting minibatches from 0); else M, as if every minibatch
    stepped, an upper bound (an accumulation crosses batches)."""
    M, ga = cfg.train.updates_per_batch, cfg.train.grad_accum
    return M // ga if M % ga == 0 else M


def batches_in_flight(cfg: RunConfig) -> int:
    """PipelineRL's W: batches untrained at once (the stream's W x B_p groups in flight,
    `rl_jax.train.stream`), W = (k + 1) // U with U the batch's optimizer steps
    (`policy_steps`), at least 1 and at most train.pipeline_waves when set."""
    w = max(1, (cfg.train.off_policy_k + 1) // policy_steps(cfg))
    return min(w, cfg.train.pipeline_waves) if cfg.train.pipeline_waves > 0 else w


def sampler_rows(cfg: RunConfig) -> int:
    """Rows the schedule has in flight at once: B_p x n, x k for ppo_off_policy's k
    batches (sampled together unless data.dynamic_sampling), x W for pipeline's W."""
    off = cfg.train.off_policy
    ppo = off == "ppo_off_policy" and not cfg.data.dynamic_sampling
    batches = cfg.train.off_policy_k if ppo else batches_in_flight(cfg) if off == "pipeline" else 1
    return batches * cfg.data.prompts_per_batch * cfg.sampling.n


def decode_chunk(cfg: RunConfig) -> int:
    """PipelineRL's decode steps between weight swaps: the stream's generate chunk
    (sampling.decode_chunk, else a quarter of the generation budget)."""
    return cfg.sampling.decode_chunk or max(1, -(-cfg.sampling.max_new_tokens // 4))


def step_flops(
    spec: Any,
    cfg: RunConfig,
    prompt_lens_p: Sequence[float],
    completion_lens_b: Sequence[float],
) -> dict[str, float]:
    """{"sampler_flops", "trainer_flops"} of one RL step on these rollouts (a run counts
    its real lengths; a grid or a plan, the lengths it expects)."""
    fwd = forward_flops(spec, prompt_lens_p, completion_lens_b, cfg.sampling.n)
    return {"sampler_flops": fwd, "trainer_flops": (TRAIN_PASSES + extra_forwards(cfg)) * fwd}
