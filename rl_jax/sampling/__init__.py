"""Compiled batched sampling: prefill once per prompt, `while_loop` decode, weights as arguments.

    sampler = Sampler(spec, SamplingConfig(...), mesh=mesh, eos_id=eos, pad_id=pad)
    rollouts = sampler.generate(params, prompt_ids, n=G, seed=0)

    engine = Engine(spec, cfg, slots=S, mesh=mesh, eos_id=eos, pad_id=pad)  # continuous
    rollouts, stats = engine.run(params, prompt_ids, n=G, seed=0)         # batching

Reported log-probs are of the temperature-scaled distribution the token was
drawn from, before top-k/top-p truncation (temperature 1 for greedy); recompute
them with `rl_jax.models.token_logprobs(..., temperature=logprob_temperature(t))`.
"""

from rl_jax.sampling._dist import logprob_temperature, sample_logits
from rl_jax.sampling._engine import ChunkOut, Engine, EngineState, Prefix, RunStats
from rl_jax.sampling._rollouts import FinishReason, Rollouts, concat_groups
from rl_jax.sampling._sampler import Sampler, pack_prompts
from rl_jax.sampling._state import SamplerState

__all__ = [
    "ChunkOut",
    "Engine",
    "EngineState",
    "Prefix",
    "RunStats",
    "FinishReason",
    "Rollouts",
    "Sampler",
    "SamplerState",
    "concat_groups",
    "logprob_temperature",
    "pack_prompts",
    "sample_logits",
]
