"""The FLOPs a compiled train step should count: the model's (forward + backward, causal
attention once: `rl_jax.train.accounting`) plus what the memory strategy recomputes.

Recomputed work is not model work, so a plan's `flops_analytic` (and its MFU) leaves it
out; `flops_expected` adds it, so that compiled / expected isolates waste (masked
blocks, padding, work XLA duplicates). What each knob recomputes in the backward:

* `model.remat=full`: every layer's forward (weights and attention) once more;
* `model.remat=save_dots`: the layers' attention (its products have batch dimensions,
  the policy keeps only the weight matmuls' outputs);
* blockwise attention (`kernels.flash_attention`): each block pair's scores q.k, half
  of the attention's forward FLOPs, whatever the remat policy (it computes only the
  block pairs on or below the causal diagonal, so its forward is the causal count plus
  the diagonal blocks' hidden half: waste, left out here);
* the chunked LM head (`model.logprob_chunk`): each chunk's logits, one more LM head
  forward over the completions.
"""

from __future__ import annotations

from typing import Any

from rl_jax.models.logprobs import chunk_size
from rl_jax.models.transformer import uses_blockwise
from rl_jax.train.accounting import TRAIN_PASSES, forward_flops


def train_flops(spec: Any, P: int, G: int, tp: int, tg: int) -> dict[str, float]:
    """{"model": forward + backward over P prompts x G completions of tp + tg tokens,
    "recompute": what `spec`'s remat policy, attention and LM head chunking add,
    "expected": their sum} for the whole batch (all minibatches)."""
    fwd = forward_flops(spec, [tp] * P, [tg] * (P * G), G)
    per_key = spec.flops_per_token(1) - spec.flops_per_token(0)
    # Attention of the prompt stream (once per group) and of the completions (each
    # over its prompt and its own earlier tokens): forward_flops' per-key terms.
    attn_p = P * per_key * tp * (tp + 1) / 2
    attn_c = P * G * per_key * tg * (tp + (tg + 1) / 2)
    head = 2 * spec.vocab_size * spec.hidden_size
    head_all = head * (P * tp + P * G * tg)  # forward_flops counts it for every token
    recompute = 0.0
    if spec.remat == "full":
        recompute += fwd - head_all  # the layers, not the LM head
    elif spec.remat == "save_dots":
        recompute += attn_p + attn_c
    recompute += 0.5 * (attn_p * uses_blockwise(spec, tp) + attn_c * uses_blockwise(spec, tp + tg))
    if chunk_size(spec.logprob_chunk, tg, spec.vocab_size):
        recompute += head * P * G * tg
    model = TRAIN_PASSES * fwd
    return {"model": model, "recompute": recompute, "expected": model + recompute}
