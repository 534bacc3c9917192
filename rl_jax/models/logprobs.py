"""Per-token log-probs and entropies without [B, T, V] float32 logits at once.

Alignment (the trainer's and the sampler's contract): with the default targets,
    logp[b, t] = log p(tokens[b, t + 1] | tokens[b, : t + 1])   for t < T - 1,
    logp[b, T - 1] = 0 and entropy[b, T - 1] = 0   (no next token),
so the log-prob of token j sits at column j - 1: mask completions with
`mask_bt[:, 1:]` against `logp[:, :-1]`. Explicit `targets_bt` score
targets[b, t] at every column instead (nothing zeroed).

`temperature` divides the logits before the softmax, as the sampler does when
it samples at that temperature; pass the sampler's temperature to compare with
its log-probs, 1.0 for the model's own distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl_jax.kernels import SEQUENCE_TILE, loops
from rl_jax.knobs import ConfigError
from rl_jax.models.layers import logprobs_from_logits
from rl_jax.models.transformer import Transformer, lm_logits

# Logits per row and chunk of `model.logprob_chunk=-1` (auto): 64 MB of float32.
AUTO_CHUNK_LOGITS = 2**24


def chunk_size(chunk: int, T: int, V: int) -> int:
    """Time steps per chunk of the LM head (`model.logprob_chunk`); 0 = all T at once.
    -1 (auto): AUTO_CHUNK_LOGITS / V steps when a row's T x V logits exceed
    AUTO_CHUNK_LOGITS, else all at once (small models stay unchunked); rounded down to
    a multiple of the largest sequence tile where that leaves one (else at least 1), so
    that splitting T into chunks is a free reshape on every platform
    (`rl_jax.kernels.SEQUENCE_TILE`)."""
    if chunk == -1:
        tile = max(SEQUENCE_TILE.values())
        steps = AUTO_CHUNK_LOGITS // V
        steps = steps // tile * tile if steps >= tile else max(1, steps)
        chunk = steps if T * V > AUTO_CHUNK_LOGITS else 0
    return 0 if chunk >= T else chunk


def logprobs_from_hidden(
    model: Transformer,
    hidden_btd: jax.Array,
    targets_bt: jax.Array,
    *,
    temperature: float | jax.Array = 1.0,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(log p(targets), entropy), float32 [B, T], from the residual stream.

    Logits are built `chunk` time steps at a time (default `spec.logprob_chunk`;
    0 = all at once, -1 = auto: `chunk_size`) inside a rematerialized map, so the
    forward keeps one [B, chunk, V] float32 block alive and the backward recomputes
    it per chunk.
    """
    spec = model.spec
    B, T, D = hidden_btd.shape
    chunk = chunk_size(spec.logprob_chunk if chunk is None else chunk, T, spec.vocab_size)
    norm_w, head_vd = model.final_norm[...], model.head_weight()

    def one(h_btd, tgt_bt):
        logits = lm_logits(spec, norm_w, head_vd, h_btd, kernels=model.kernels)
        logits = model.constrain(logits, ("batch", "seq", "vocab"))
        return logprobs_from_logits(logits, tgt_bt, temperature)

    if chunk == 0:
        # The entropy with the log-probs, while the forward holds the logits (`together`;
        # a chunk's are confined to its iteration of the map below).
        return model.kernels.together(one, hidden_btd, targets_bt)
    n = -(-T // chunk)
    pad = n * chunk - T
    h = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    tg = jnp.pad(targets_bt, ((0, 0), (0, pad)))
    h = h.reshape(B, n, chunk, D).swapaxes(0, 1)  # [n, B, c, D]
    tg = tg.reshape(B, n, chunk).swapaxes(0, 1)  # [n, B, c]
    # `loops.scan`: rolled in a run, and `rl-jax plan` counts every chunk.
    _, (logp, ent) = loops.scan(
        lambda _, a: (None, jax.checkpoint(one)(*a)), None, (h, tg), name="lm_head_chunks"
    )
    logp = logp.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
    ent = ent.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]
    return logp, ent


def next_token_targets(tokens_bt: jax.Array) -> jax.Array:
    """tokens shifted left by one; the last column (no next token) is 0."""
    return jnp.concatenate([tokens_bt[:, 1:], jnp.zeros_like(tokens_bt[:, :1])], axis=1)


def token_logprobs(
    model: Transformer,
    tokens_bt: jax.Array,
    positions_bt: jax.Array | None = None,
    *,
    segment_ids_bt: jax.Array | None = None,
    kv_valid_bt: jax.Array | None = None,
    targets_bt: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Full-sequence forward, then chunked log-probs and entropies [B, T] (see module doc)."""
    hidden, _ = model(
        tokens_bt, positions_bt, segment_ids_bt=segment_ids_bt, kv_valid_bs=kv_valid_bt
    )
    if targets_bt is not None:
        return logprobs_from_hidden(model, hidden, targets_bt, temperature=temperature, chunk=chunk)
    logp, ent = logprobs_from_hidden(
        model, hidden, next_token_targets(tokens_bt), temperature=temperature, chunk=chunk
    )
    has_next = jnp.arange(tokens_bt.shape[1]) < tokens_bt.shape[1] - 1
    return jnp.where(has_next, logp, 0.0), jnp.where(has_next, ent, 0.0)


def score_tokens(
    model: Transformer, ids: list[int], *, chunk: int = 0, temperature: float = 1.0
) -> list[float]:
    """logprobs[i] = log p(ids[i+1] | ids[:i+1]) under `model`."""
    V = model.spec.vocab_size
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary [0, {V})")
    if len(ids) < 2:
        return []
    fn = nnx.jit(lambda m, t: token_logprobs(m, t, chunk=chunk, temperature=temperature)[0])
    logp = fn(model, jnp.asarray([ids], jnp.int32))
    return [float(x) for x in logp[0, :-1]]
