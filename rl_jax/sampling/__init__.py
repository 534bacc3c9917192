"""Compiled sampling on a continuous-batching engine: prefill once per prompt, decode
slots refilled as their rows end, weights as arguments.

    engine = Engine(spec, cfg, slots=S, mesh=mesh, eos_id=eos, pad_id=pad)
    rollouts, stats = engine.run(params, prompt_ids, n=G, seed=0)
    # one batch, a slot for each of its rows, decoded to the end in one call:
    engine = Engine.for_batch(spec, cfg, prompts=P, prompt_len=T, eos_id=eos, pad_id=pad)

Reported log-probs are of the temperature-scaled distribution the token was
drawn from, before top-k/top-p truncation (temperature 1 for greedy); recompute
them with `rl_jax.models.token_logprobs(..., temperature=logprob_temperature(t))`.
"""

from rl_jax.sampling._decoder import pack_prompts
from rl_jax.sampling._dist import logprob_temperature, sample_logits
from rl_jax.sampling._engine import ChunkOut, Engine, RunStats
from rl_jax.sampling._engine_programs import DecodeWeights, EngineState, Prefix
from rl_jax.sampling._rollouts import FinishReason, Rollouts, concat_groups
from rl_jax.sampling._state import SamplerState

__all__ = [
    "ChunkOut",
    "DecodeWeights",
    "Engine",
    "EngineState",
    "Prefix",
    "RunStats",
    "FinishReason",
    "Rollouts",
    "SamplerState",
    "concat_groups",
    "logprob_temperature",
    "pack_prompts",
    "sample_logits",
]
