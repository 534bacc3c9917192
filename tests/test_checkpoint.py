"""Checkpoint checksums computed in pieces, and the save formats a run can meet."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rl_jax.train import checkpoint
from rl_jax.train.checkpoint import Checkpointer, seal_meta, state_checksums


def _reference_digest(x) -> str:
    """The checksum's formula over the whole array at once, in numpy (uint32 wrap-around)."""
    x = np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    if x.dtype == np.bool_:
        bits = x.astype(np.uint32)
    else:
        bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint32)
    bits = bits.reshape(-1)
    i = np.arange(bits.size, dtype=np.uint32)
    w1 = i * np.uint32(2654435761) + np.uint32(1)
    w2 = (i ^ np.uint32(0x5BD1E995)) * np.uint32(0x85EBCA6B) | np.uint32(1)
    a = np.sum(bits * w1, dtype=np.uint32)
    b = np.sum((bits ^ (bits >> np.uint32(15))) * w2, dtype=np.uint32)
    return f"{int(a):08x}{int(b):08x}"


def test_checksums_in_pieces_equal_the_whole_array_formula(monkeypatch):
    # Pieces of 1,000 elements: several full ones and a remainder, one piece, none.
    monkeypatch.setattr(checkpoint, "CHECKSUM_CHUNK", 1000)
    checkpoint._jitted_checksums.cache_clear()
    rng = np.random.default_rng(0)
    state = {
        "f32": rng.standard_normal((7, 513)).astype(np.float32),
        "bf16": jnp.asarray(rng.standard_normal(3000), jnp.bfloat16),
        "f16": rng.standard_normal(999).astype(np.float16),
        "i32": rng.integers(-9, 9, (2000,)).astype(np.int32),
        "scalar": np.int32(4),
        "bool": rng.integers(0, 2, 1500).astype(bool),
        "u8": rng.integers(0, 255, 2500).astype(np.uint8),
        "key": jax.random.key(3),
        "empty": np.zeros((0, 3), np.float32),
        "bad": np.array([1.0, np.nan, np.inf] * 700, np.float32),
    }
    try:
        digests, nonfinite = state_checksums(state)
    finally:
        checkpoint._jitted_checksums.cache_clear()
    for k, v in state.items():
        assert digests[f"['{k}']"] == _reference_digest(v), k
    assert nonfinite == {"['bad']": 1400}


@pytest.mark.parametrize("compress", [False, True])
def test_checkpoint_round_trip_compressed_or_not(tmp_path, compress):
    ck = Checkpointer(tmp_path / "ck", async_save=False, compress=compress)
    st = {"w": jnp.arange(12.0).reshape(3, 4), "n": jnp.array(5, jnp.int32)}
    assert ck.save(3, st, {"it": 3})
    step, restored, meta = ck.restore_latest(jax.tree.map(jnp.zeros_like, st))
    ck.close()
    assert step == 3 and meta == {"it": 3}
    for k in st:
        np.testing.assert_array_equal(restored[k], st[k])


def test_a_checkpoint_of_the_standard_handler_restores(tmp_path):
    """Checkpoints written before the state had its own handler (StandardSave) load."""
    st = {"w": jnp.arange(6.0).reshape(2, 3)}
    sums, _ = state_checksums(st)
    old = ocp.CheckpointManager(tmp_path / "ck", options=ocp.CheckpointManagerOptions(create=True))
    old.save(
        1,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(st),
            meta=ocp.args.JsonSave(seal_meta({"it": 1, checkpoint.CHECKSUMS: sums})),
        ),
    )
    old.wait_until_finished()
    old.close()
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    step, restored, meta = ck.restore_latest(st)
    ck.close()
    assert step == 1 and meta == {"it": 1}
    np.testing.assert_array_equal(restored["w"], st["w"])
