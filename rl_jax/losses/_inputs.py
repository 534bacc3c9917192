"""`LossInputs` and the row / sequence / group bookkeeping every loss shares.

A batch is a [B, T] grid of tokens. Unpacked (the default), each row holds one
sequence (prompt + completion + padding) and per-row fields are [B]. Packed,
several sequences share a row: `seq_ids` [B, T] names each token's sequence
(ints in [0, num_seqs)) and `advantages` and `group_ids` must then be given per
token, [B, T]. Everything here is jit-safe: group and sequence reductions are
segment sums with a static number of segments (`num_groups`, `num_seqs`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class LossInputs:
    """Per-token inputs of a policy loss; a pytree, so it can cross `jax.jit`.

    Fields (shapes use B batch rows, T tokens):
      logp:         [B, T] trainer log-probs of the sampled tokens (differentiated).
      sampler_logp: [B, T] behaviour-policy log-probs, as reported by the sampler.
      advantages:   [B] per sequence, or [B, T] per token.
      mask:         [B, T] 1 on trained completion tokens only (no prompt, padding
                    or injected interruption tokens); read as a boolean.
      group_ids:    [B] (or [B, T] when packed) prompt of each row, ints in
                    [0, num_groups).
      old_logp:     [B, T] policy at the start of this batch's updates (optional;
                    the importance ratio is against it when given, else against
                    `sampler_logp`).
      ref_logp:     [B, T] reference-model log-probs (optional; for KL).
      entropy:      [B, T] per-token policy entropy from the model (optional; for
                    the entropy bonus, differentiated).
      values:       [B, T] or [B] critic predictions (optional; PPO's critic).
      old_values:   like `values`, the critic at rollout time (for value clipping).
      returns:      like `values`, the critic's regression targets (e.g. from GAE).
      seq_ids:      [B, T] sequence of each token when packed (optional).
    """

    logp: Array
    sampler_logp: Array
    advantages: Array
    mask: Array
    group_ids: Array
    old_logp: Array | None = None
    ref_logp: Array | None = None
    entropy: Array | None = None
    values: Array | None = None
    old_values: Array | None = None
    returns: Array | None = None
    seq_ids: Array | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """How tokens map to sequences and groups; built once per loss call.

    seq_ids None means one sequence per row (unpacked), reduced with plain row
    sums; otherwise sequence reductions are segment sums over `num_seqs`.
    """

    mask: Array  # [B, T] bool
    group_bt: Array  # [B, T] int32
    seq_ids: Array | None  # [B, T] int32 when packed
    num_seqs: int

    def seq_sum(self, x_bt: Array) -> Array:
        """Sum of x over each sequence's tokens (x already masked); [S]."""
        if self.seq_ids is None:
            return x_bt.sum(axis=-1)
        return jax.ops.segment_sum(x_bt.ravel(), self.seq_ids.ravel(), self.num_seqs)

    def seq_broadcast(self, x_s: Array) -> Array:
        """Per-sequence values back onto their tokens; [B, T]."""
        if self.seq_ids is None:
            return jnp.broadcast_to(x_s[:, None], self.mask.shape)
        return x_s[self.seq_ids]

    def group_sum(self, x_bt: Array, num_groups: int) -> Array:
        """Sum of x over each group's tokens (x already masked); [P]."""
        return jax.ops.segment_sum(x_bt.ravel(), self.group_bt.ravel(), num_groups)


def masked(x: Array, mask: Array) -> Array:
    """x where mask, else 0. A select, not a product, so inf/NaN padding stays out
    of values and gradients alike."""
    return jnp.where(mask, x, jnp.zeros((), x.dtype))


def f32(x: Array) -> Array:
    return jnp.asarray(x, jnp.float32)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_ids(name: str, ids, num: int | None, what: str, used=None) -> None:
    """Outside jit, fail early on ids that segment sums would silently drop.

    Only entries where `used` is true are checked: padding may carry any id.
    """
    if num is None or not (_is_concrete(ids) and _is_concrete(used)):
        return
    ids_np = np.asarray(ids)
    if used is not None:
        ids_np = ids_np[np.broadcast_to(np.asarray(used), ids_np.shape)]
    if ids_np.size and (ids_np.min() < 0 or ids_np.max() >= num):
        raise ValueError(
            f"{name} must lie in [0, {what}={num}); got values in "
            f"[{ids_np.min()}, {ids_np.max()}]. Pass a larger {what} or renumber."
        )


def _check_shape(name: str, x, allowed: tuple[tuple[int, ...], ...]) -> None:
    if x is not None and tuple(x.shape) not in allowed:
        raise ValueError(
            f"LossInputs.{name} has shape {tuple(x.shape)}; expected one of "
            f"{[list(a) for a in allowed]}"
        )


def make_layout(inputs: LossInputs, *, num_seqs: int | None, num_groups: int | None) -> Layout:
    """Validate shapes and build the token -> sequence / group maps."""
    if inputs.logp.ndim != 2:
        raise ValueError(f"LossInputs.logp must be [B, T]; got shape {tuple(inputs.logp.shape)}")
    b, t = inputs.logp.shape
    bt = ((b, t),)
    for name in ("sampler_logp", "mask", "old_logp", "ref_logp", "entropy", "seq_ids"):
        _check_shape(name, getattr(inputs, name), bt)
    packed = inputs.seq_ids is not None
    per_row = bt if packed else ((b,), (b, t))
    for name in ("advantages", "group_ids", "values", "old_values", "returns"):
        _check_shape(name, getattr(inputs, name), per_row)
    mask = jnp.asarray(inputs.mask) > 0
    group_ids = jnp.asarray(inputs.group_ids, jnp.int32)
    row_used = mask.any(axis=-1) if group_ids.ndim == 1 else mask
    check_ids("LossInputs.group_ids", inputs.group_ids, num_groups, "num_groups", row_used)
    group_bt = jnp.broadcast_to(group_ids[:, None], (b, t)) if group_ids.ndim == 1 else group_ids
    if not packed:
        return Layout(mask=mask, group_bt=group_bt, seq_ids=None, num_seqs=b)
    if num_seqs is None:
        raise ValueError(
            "packed LossInputs (seq_ids given) need num_seqs: the static number of "
            "sequences, with seq_ids in [0, num_seqs)"
        )
    check_ids("LossInputs.seq_ids", inputs.seq_ids, num_seqs, "num_seqs", mask)
    seq_ids = jnp.asarray(inputs.seq_ids, jnp.int32)
    return Layout(mask=mask, group_bt=group_bt, seq_ids=seq_ids, num_seqs=num_seqs)


def per_token(x, layout: Layout) -> Array:
    """A [B] per-row field broadcast to [B, T]; [B, T] fields pass through."""
    x = f32(x)
    if x.ndim == 1:
        return jnp.broadcast_to(x[:, None], layout.mask.shape)
    return x
