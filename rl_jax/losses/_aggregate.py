"""Reducing per-token values [B, T] to the scalar that is differentiated.

Every mode ignores masked tokens and gives nothing to, and does not count,
sequences or prompts with no trained token: adding a fully masked row, or
masked tokens to a row, changes no result. A batch with no trained token at
all reduces to 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._inputs import Layout, check_ids, f32, masked

AGGREGATIONS = ("token", "sample", "prompt", "seq_sum")

Array = jax.Array


def _safe_div(num: Array, den: Array) -> Array:
    return num / jnp.maximum(den, 1.0)


def aggregate_layout(
    values_bt: Array,
    layout: Layout,
    mode: str,
    *,
    num_groups: int | None = None,
    seq_sum_constant: float | None = None,
) -> Array:
    """`aggregate` on a prepared `Layout` (used inside `policy_loss`)."""
    m = layout.mask
    v = masked(f32(values_bt), m)
    mf = m.astype(jnp.float32)
    if mode == "token":
        # (1/N) sum_{b,t} v_bt with N the number of trained tokens in the batch.
        return _safe_div(v.sum(), mf.sum())
    if mode == "sample":
        # (1/S) sum_s (1/n_s) sum_{t in s} v_t over the S sequences with n_s > 0.
        n_s = layout.seq_sum(mf)
        mean_s = _safe_div(layout.seq_sum(v), n_s)
        present = (n_s > 0).astype(jnp.float32)
        return _safe_div((mean_s * present).sum(), present.sum())
    if mode == "prompt":
        # (1/P') sum_g (1/N_g) sum_{t in g} v_t: each prompt's group pooled, then the
        # P' prompts with any trained token averaged, whatever their size or lengths.
        if num_groups is None:
            raise ValueError(
                "aggregation='prompt' needs num_groups: the static number of prompts P "
                "in the batch, with group_ids in [0, P)"
            )
        n_g = layout.group_sum(mf, num_groups)
        mean_g = _safe_div(layout.group_sum(v, num_groups), n_g)
        present = (n_g > 0).astype(jnp.float32)
        return _safe_div((mean_g * present).sum(), present.sum())
    if mode == "seq_sum":
        # (1/S) sum_s (1/C) sum_{t in s} v_t: Dr. GRPO's constant C replaces each
        # sequence's own length, so long and short sequences weigh tokens alike.
        c = float(m.shape[-1]) if seq_sum_constant is None else float(seq_sum_constant)
        if c <= 0:
            raise ValueError(f"seq_sum_constant={seq_sum_constant!r} must be > 0")
        n_s = layout.seq_sum(mf)
        return _safe_div(v.sum() / c, (n_s > 0).astype(jnp.float32).sum())
    raise ValueError(f"aggregation={mode!r} is not one of {list(AGGREGATIONS)}")


def aggregate(
    values_bt: Array,
    mask_bt: Array,
    group_ids: Array | None = None,
    mode: str = "token",
    num_groups: int | None = None,
    seq_sum_constant: float | None = None,
    *,
    seq_ids: Array | None = None,
    num_seqs: int | None = None,
) -> Array:
    """Reduce per-token values to a scalar; see the module docstring.

    Args:
      values_bt: [B, T] per-token values (e.g. per-token losses).
      mask_bt: [B, T] trained tokens (read as a boolean).
      group_ids: [B] (or [B, T] when packed) prompt of each row, in
        [0, num_groups); only read by mode 'prompt'.
      mode: 'token' (mean over all trained tokens of the batch), 'sample' (mean
        over sequences of each sequence's token mean; GRPO), 'prompt' (tokens of
        each prompt's group averaged together, then prompts averaged; ScaleRL) or
        'seq_sum' (each sequence's token sum divided by seq_sum_constant, averaged
        over sequences; Dr. GRPO).
      num_groups: static number of prompts P; required by 'prompt'.
      seq_sum_constant: C of 'seq_sum'; None uses T, the padded width (pass the
        generation budget when T also holds prompt tokens).
      seq_ids, num_seqs: packed rows: [B, T] sequence of each token, in
        [0, num_seqs); None means one sequence per row.
    """
    m = jnp.asarray(mask_bt) > 0
    if group_ids is None:
        group_bt = jnp.zeros(m.shape, jnp.int32)
    else:
        group_ids = jnp.asarray(group_ids, jnp.int32)
        used = m.any(axis=-1) if group_ids.ndim == 1 else m
        check_ids("group_ids", group_ids, num_groups, "num_groups", used)
        group_bt = group_ids[:, None] if group_ids.ndim == 1 else group_ids
        group_bt = jnp.broadcast_to(group_bt, m.shape)
    if mode == "prompt" and group_ids is None:
        raise ValueError("aggregation='prompt' needs group_ids")
    if seq_ids is not None:
        if num_seqs is None:
            raise ValueError("seq_ids given without num_seqs (the static number of sequences)")
        check_ids("seq_ids", seq_ids, num_seqs, "num_seqs", m)
        seq_ids = jnp.asarray(seq_ids, jnp.int32)
    layout = Layout(mask=m, group_bt=group_bt, seq_ids=seq_ids, num_seqs=num_seqs or m.shape[0])
    return aggregate_layout(
        values_bt, layout, mode, num_groups=num_groups, seq_sum_constant=seq_sum_constant
    )
