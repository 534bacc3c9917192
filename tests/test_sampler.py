"""The compiled sampler on a small random model: exactness, log-prob parity, sharding,
in-flight weight swaps, stops and forced interruption, and no recompilation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.config import MeshConfig, ModelConfig, SamplingConfig
from rl_jax.knobs import ConfigError
from rl_jax.models import (
    Transformer,
    init_params,
    param_shardings,
    positions_from_valid,
    resolve_spec,
    token_logprobs,
)
from rl_jax.sampling import FinishReason, Sampler, logprob_temperature
from rl_jax.sharding import get_rules, make_mesh

SPEC = resolve_spec(
    ModelConfig(
        preset="tiny",
        num_layers=2,
        hidden_size=64,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
    )
)
PROMPTS = [[3, 9, 4], [7, 1, 8, 2, 6, 5, 11], [12, 13, 14, 15, 16]]


def _params(seed, scale=10.0):
    """Random weights, scaled up so logits are far from ties."""
    p = init_params(SPEC, jax.random.key(seed))
    return {
        k: v * scale if k not in ("attn_norm", "mlp_norm", "final_norm") else v
        for k, v in p.items()
    }


@pytest.fixture(scope="module")
def params_a():
    return _params(0)


@pytest.fixture(scope="module")
def params_b():
    return _params(1)


@pytest.fixture(scope="module")
def mild_params():
    """Weights scaled by 3, for 60-token comparisons at float32 rounding. Scaled by 10,
    two correct summation orders of the same forward (XLA's against the CPU kernels',
    or XLA's on two machines) drift apart by up to 4e-5 in log-prob over 60 tokens:
    large weights amplify rounding layer by layer. By 3, logits are still far from
    ties and the drift stays under 2e-6 (both measured over 6 seeds)."""
    return _params(0, 3.0), _params(1, 3.0)


def _sequences(out):
    """Prompt + completion as one left-padded row, its validity mask and positions."""
    tg = out.completion_tokens.shape[1]
    tokens = np.concatenate([out.prompt_tokens, out.completion_tokens], axis=1)
    valid = np.concatenate([out.prompt_mask, np.arange(tg)[None, :] < out.lengths[:, None]], axis=1)
    return jnp.asarray(tokens), jnp.asarray(valid), positions_from_valid(jnp.asarray(valid))


@jax.jit
def _full_logits(params, tokens, valid, positions):
    model = Transformer(SPEC, params)
    hidden, _ = model(tokens, positions, kv_valid_bs=valid)
    return model.logits(hidden)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _token_logprobs(spec, params, tokens, valid, positions, temperature):
    model = Transformer(spec, params)
    return token_logprobs(model, tokens, positions, kv_valid_bt=valid, temperature=temperature)[0]


def _trainer_logprobs(spec, params, out, temperature):
    logp = _token_logprobs(spec, params, *_sequences(out), temperature)
    tp = out.prompt_tokens.shape[1]
    return np.asarray(logp)[:, tp - 1 : -1]  # column j scores completion token j


@functools.partial(jax.jit, static_argnums=(5,))
def _swapped_logits(params_a, params_b, tokens, valid, positions, split):
    """A writes the cache for tokens[:, :split], B continues from it; B's logits after."""
    ma, mb = Transformer(SPEC, params_a), Transformer(SPEC, params_b)
    cache = ma.init_cache(tokens.shape[0], tokens.shape[1])
    _, cache = ma(
        tokens[:, :split], positions[:, :split], kv_valid_bs=valid, cache=cache, cache_index=0
    )
    hidden, _ = mb(
        tokens[:, split:], positions[:, split:], kv_valid_bs=valid, cache=cache, cache_index=split
    )
    return mb.logits(hidden)


@pytest.fixture(scope="module")
def greedy():
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12, length_bucket=8, max_prompt_len=16)
    return Sampler(SPEC, cfg, pad_id=0)


def test_greedy_equals_argmax_of_full_forward(greedy, params_a):
    out = greedy.generate(params_a, PROMPTS, n=2)
    assert out.num_rows == 6 and (out.lengths == 12).all()
    assert (out.finish_reason == FinishReason.LENGTH).all() and out.truncated.all()
    np.testing.assert_array_equal(out.group_ids, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(out.completion_tokens[0::2], out.completion_tokens[1::2])
    tokens, valid, positions = _sequences(out)
    logits = np.asarray(_full_logits(params_a, tokens, valid, positions))
    tp = out.prompt_tokens.shape[1]
    pred = logits[:, tp - 1 : -1].argmax(-1)  # the prediction for every completion column
    m = out.completion_mask
    assert m.sum() == 6 * 12
    np.testing.assert_array_equal(pred[m], out.completion_tokens[m])
    ref = jax.nn.log_softmax(logits[:, tp - 1 : -1], axis=-1)
    ref = np.take_along_axis(np.asarray(ref), out.completion_tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs[m], ref[m], atol=1e-5)
    assert (out.versions[m] == 0).all()


@pytest.fixture(scope="module")
def sampled_cfg():
    return SamplingConfig(
        temperature=0.7, top_k=20, max_new_tokens=10, length_bucket=8, max_prompt_len=16
    )


@pytest.mark.parametrize("fp32_lm_head", [False, True])
def test_logprobs_match_trainer_recomputation(params_a, sampled_cfg, fp32_lm_head):
    spec = SPEC.replace(fp32_lm_head=fp32_lm_head)
    sampler = Sampler(spec, sampled_cfg, pad_id=0)
    out = sampler.generate(params_a, PROMPTS[:2], n=3, seed=4, version=5)
    assert len(set(map(tuple, out.completion_tokens[:3]))) > 1  # samples differ
    ref = _trainer_logprobs(spec, params_a, out, logprob_temperature(sampled_cfg.temperature))
    m = out.completion_mask
    np.testing.assert_allclose(out.logprobs[m], ref[m], atol=1e-5)
    assert (out.versions[m] == 5).all() and (out.versions[~m] == -1).all()


def test_bfloat16_sampling_matches_trainer_recomputation(params_a, sampled_cfg):
    """bf16 weights and activations on CPU: the 8-token prompts reach attention layouts whose
    bf16 x bf16 -> f32 dot XLA:CPU's generic kernel lacks (it raised before einsum_f32)."""
    spec = SPEC.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = {k: v.astype(jnp.bfloat16) for k, v in params_a.items()}
    sampler = Sampler(spec, sampled_cfg, pad_id=0)
    prompts = [list(range(3, 11)), list(range(20, 28))]
    out = sampler.generate(params, prompts, n=2, seed=1)
    assert (out.lengths == sampled_cfg.max_new_tokens).all()
    ref = _trainer_logprobs(spec, params, out, logprob_temperature(sampled_cfg.temperature))
    m = out.completion_mask
    assert np.isfinite(out.logprobs[m]).all() and (out.logprobs[m] <= 0).all()
    # bf16 rounds the two computations' different orders of operations differently.
    np.testing.assert_allclose(out.logprobs[m], ref[m], atol=0.25)
    assert np.abs(out.logprobs[m] - ref[m]).mean() < 0.05


@pytest.mark.devices(8)
def test_same_rows_on_one_and_eight_devices(params_a, sampled_cfg):
    one = Sampler(SPEC, sampled_cfg, pad_id=0)
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    eight = Sampler(SPEC, sampled_cfg, pad_id=0, mesh=mesh)
    key = jax.random.key(11)
    a = one.generate(params_a, PROMPTS[:2], n=3, key=key)
    b = eight.generate(eight.reshard(params_a), PROMPTS[:2], n=3, key=key)  # 6 rows -> 8
    assert b.num_rows == 6
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    # A row's draws depend on its id, not its place in the batch.
    c = one.generate(params_a, PROMPTS[1:2], n=3, key=key, row_ids=[3, 4, 5])
    np.testing.assert_array_equal(c.completion_tokens, a.completion_tokens[3:])


@pytest.mark.devices(8)
def test_trainer_layout_weights_on_a_data_fsdp_mesh(params_a, sampled_cfg):
    """FSDP-sharded weights (the trainer's layout) are used as they are; rows split
    over data x fsdp; the draws equal one device's."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    train_layout = param_shardings(SPEC, mesh, get_rules("fsdp", purpose="train"))
    params = jax.device_put(params_a, train_layout)
    assert "fsdp" in str(params["gate"].sharding.spec)
    key = jax.random.key(11)
    sharded = Sampler(SPEC, sampled_cfg, pad_id=0, mesh=mesh).generate(
        params, PROMPTS[:2], n=3, key=key
    )
    one = Sampler(SPEC, sampled_cfg, pad_id=0).generate(params_a, PROMPTS[:2], n=3, key=key)
    np.testing.assert_array_equal(sharded.completion_tokens, one.completion_tokens)
    np.testing.assert_allclose(sharded.logprobs, one.logprobs, atol=1e-5)


def test_decode_cache_block_sizes():
    """Short caches stay whole; long ones are rounded up to ~8 blocks of 16k slots (at
    most 512); accelerators keep one piece."""
    from rl_jax.kernels.xla import decode_cache_blocks

    cases = {72: (72, 72), 128: (128, 128), 136: (160, 32), 264: (288, 48)}
    cases |= {1032: (1152, 144), 16392: (16896, 512)}
    for slots, want in cases.items():
        got = decode_cache_blocks(slots, "cpu")
        assert got == want and got[0] % got[1] == 0 and got[0] - slots < got[1], slots
    assert decode_cache_blocks(1032, "gpu") == (1032, 1032)


@pytest.fixture
def small_blocks(monkeypatch):
    """Caches of more than 8 slots split into blocks of 16 (long generations do this)."""
    from rl_jax.kernels import xla

    monkeypatch.setattr(xla, "DECODE_BLOCK_MIN_SLOTS", 8)
    monkeypatch.setattr(xla, "DECODE_BLOCKS", 64)
    monkeypatch.setattr(xla, "DECODE_BLOCK_PLATFORMS", (jax.devices()[0].platform,))
    return xla


@pytest.fixture
def no_kernel(monkeypatch):
    """Decode attention in XLA (the CPU kernel off), whatever the machine can build."""
    monkeypatch.setattr(Sampler, "platform_attention", False)


def _assert_decodes_as_the_whole_cache(layout, params_a, params_b, check_cache, monkeypatch):
    """Greedy tokens are the full forward's argmax, sampled log-probs match the
    trainer's within 1e-5, and the draws equal the whole-cache XLA decode's, also on 8
    devices and after a weight swap between decode chunks. A 2-token prompt beside a
    20-token one leaves the short row's first block or tiles wholly padding."""
    prompts = [[5, 6], list(range(3, 23))]
    greedy_cfg = SamplingConfig(
        temperature=0.0, max_new_tokens=40, length_bucket=8, max_prompt_len=24
    )
    sampler = Sampler(SPEC, greedy_cfg, pad_id=0)
    state = sampler.start(params_a, prompts, n=2)
    check_cache(*state.cache)
    out = sampler.result(sampler.decode(params_a, state))
    assert (out.lengths == 40).all()
    tokens, valid, positions = _sequences(out)
    logits = np.asarray(_full_logits(params_a, tokens, valid, positions))
    tp = out.prompt_tokens.shape[1]
    assert tp == 24
    np.testing.assert_array_equal(logits[:, tp - 1 : -1].argmax(-1), out.completion_tokens)
    ref = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits[:, tp - 1 : -1])), out.completion_tokens[..., None], -1
    )[..., 0]
    np.testing.assert_allclose(out.logprobs, ref, atol=1e-5)

    cfg = SamplingConfig(temperature=0.7, max_new_tokens=40, length_bucket=8, max_prompt_len=24)
    key = jax.random.key(3)
    got = Sampler(SPEC, cfg, pad_id=0).generate(params_a, prompts, n=3, key=key)
    ref = _trainer_logprobs(SPEC, params_a, got, logprob_temperature(0.7))
    np.testing.assert_allclose(got.logprobs, ref, atol=1e-5)
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    eight = Sampler(SPEC, cfg, pad_id=0, mesh=mesh)
    check_cache(*eight.start(eight.reshard(params_a), prompts, n=2).cache)
    on_eight = eight.generate(eight.reshard(params_a), prompts, n=3, key=key)
    np.testing.assert_array_equal(on_eight.completion_tokens, got.completion_tokens)
    np.testing.assert_allclose(on_eight.logprobs, got.logprobs, atol=1e-5)

    def swapped(sampler):  # 5 tokens from A, the rest from B on A's cache
        state = sampler.start(params_a, prompts, n=2, key=key)
        state = sampler.decode(params_a, state, max_steps=5, version=1)
        return sampler.result(sampler.decode(params_b, state, version=2))

    got_swap = swapped(Sampler(SPEC, cfg, pad_id=0))
    # The reference: one piece, attention and matmuls in XLA (monkeypatch restores all).
    monkeypatch.setattr(layout, "DECODE_BLOCK_MIN_SLOTS", 10_000)
    monkeypatch.setattr(Sampler, "platform_attention", False)
    monkeypatch.setattr(Sampler, "platform_matmul", False)
    whole_sampler = Sampler(SPEC, cfg, pad_id=0)
    assert not whole_sampler.decode_ops.platform_ops
    keys, values = whole_sampler.start(params_a, prompts, n=1).cache
    assert keys.ndim == values.ndim == 5  # [L, B, K, hd, S], [L, B, K, S, hd]
    whole = whole_sampler.generate(params_a, prompts, n=3, key=key)
    np.testing.assert_array_equal(whole.completion_tokens, got.completion_tokens)
    np.testing.assert_allclose(whole.logprobs, got.logprobs, atol=1e-5)
    whole_swap = swapped(whole_sampler)
    assert (whole_swap.versions[:, :5] == 1).all() and (whole_swap.versions[:, 5:] == 2).all()
    np.testing.assert_array_equal(whole_swap.completion_tokens, got_swap.completion_tokens)
    np.testing.assert_allclose(whole_swap.logprobs, got_swap.logprobs, atol=1e-5)


@pytest.mark.devices(8)
def test_blocked_cache_decodes_as_the_whole_cache(
    small_blocks, no_kernel, mild_params, monkeypatch
):
    """The block-at-a-time decode (only the blocks written so far, online softmax)
    equals the one-pass decode (_assert_decodes_as_the_whole_cache)."""
    assert small_blocks.decode_cache_blocks(24 + 40, jax.devices()[0].platform) == (64, 16)
    assert small_blocks.decode_cache_blocks(24 + 40, "other") == (64, 64)

    def check(keys, values):  # [L, B, N, K, hd, blk], [L, B, N, K, blk, hd]
        assert keys.shape[0] == values.shape[0] == SPEC.num_layers
        assert keys.shape[2:] == (4, SPEC.num_kv_heads, SPEC.head_dim, 16)
        assert values.shape[2:] == (4, SPEC.num_kv_heads, 16, SPEC.head_dim)

    _assert_decodes_as_the_whole_cache(small_blocks, *mild_params, check, monkeypatch)


@pytest.mark.devices(8)
def test_cpu_kernels_decode_as_the_whole_cache(mild_params, monkeypatch):
    """The CPU kernels' decode (keys in tiles of 16 slots, only filled slots read;
    projections and LM head on packed weights) equals XLA's one-pass decode
    (_assert_decodes_as_the_whole_cache)."""
    from rl_jax.kernels import cpu as _cpu_kernels
    from rl_jax.kernels import xla

    if jax.devices()[0].platform != "cpu" or not _cpu_kernels.available():
        pytest.skip("the CPU decode kernels cannot be built here (no C++ compiler)")
    sampler = Sampler(SPEC, SamplingConfig(), pad_id=0)
    assert sampler.decode_ops.platform_ops == ("attention", "matmul")

    def check(keys, values):  # [L, B, K, S / 16, hd, 16] tiles, [L, B, K, S, hd]
        assert keys.shape[0] == values.shape[0] == SPEC.num_layers
        assert keys.shape[2:] == (SPEC.num_kv_heads, 4, SPEC.head_dim, 16)
        assert values.shape[2:] == (SPEC.num_kv_heads, 64, SPEC.head_dim)

    _assert_decodes_as_the_whole_cache(xla, *mild_params, check, monkeypatch)


def test_weight_swap_mid_sequence_continues_from_stale_cache(greedy, params_a, params_b):
    k = 4
    state = greedy.start(params_a, PROMPTS, n=1)
    state = greedy.decode(params_a, state, max_steps=k, version=1)
    assert not greedy.done(state)
    state = greedy.decode(params_b, state, max_steps=3, version=2)
    state = greedy.decode(params_b, state, version=2)
    out = greedy.result(state)
    np.testing.assert_array_equal(out.versions[:, :k], 1)
    np.testing.assert_array_equal(out.versions[:, k:12], 2)
    assert (out.lengths == 12).all()

    # Reference with the model's own cached forward: A writes the cache for the
    # prompt and the first k - 1 completion tokens (the k-th token is fed by the
    # first step after the swap), then B continues from that cache.
    tp = out.prompt_tokens.shape[1]
    logits = _swapped_logits(params_a, params_b, *_sequences(out), tp + k - 1)
    logits = np.asarray(logits)[:, : 12 - k]  # predictions of completion k .. 11
    np.testing.assert_array_equal(logits.argmax(-1), out.completion_tokens[:, k:12])
    ref = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits)), out.completion_tokens[:, k:12, None], -1
    )[..., 0]
    np.testing.assert_allclose(out.logprobs[:, k:12], ref, atol=1e-5)
    # The swap mattered: neither model alone gives this continuation.
    only_a = greedy.generate(params_a, PROMPTS, n=1)
    only_b = greedy.generate(params_b, PROMPTS, n=1)
    np.testing.assert_array_equal(only_a.completion_tokens[:, :k], out.completion_tokens[:, :k])
    assert (only_a.completion_tokens[:, k:] != out.completion_tokens[:, k:]).any()
    assert (only_b.completion_tokens != out.completion_tokens).any()


def test_no_recompilation_for_new_weights_chunks_and_bucketed_lengths(greedy, params_a, params_b):
    greedy.generate(params_a, PROMPTS, n=2)
    before = greedy.compile_counts()
    shifted = [[t + 1 for t in p] for p in PROMPTS]  # other tokens, same bucket
    state = greedy.start(params_b, [p[:-1] for p in shifted], n=2)
    for steps in (1, 2, 5):
        state = greedy.decode(params_b if steps % 2 else params_a, state, max_steps=steps)
    greedy.generate(params_b, shifted, n=2, max_new_tokens=9)  # same generation bucket
    assert greedy.compile_counts() == before


def test_stop_tokens_end_rows_early(params_a):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12, length_bucket=8, max_prompt_len=16)
    free = Sampler(SPEC, cfg, pad_id=0).generate(params_a, PROMPTS, n=1)
    stop = int(free.completion_tokens[0, 2])
    first = [
        int(np.argmax(r == stop)) if (r == stop).any() else None for r in free.completion_tokens
    ]
    sampler = Sampler(SPEC, cfg, pad_id=0, eos_id=stop)
    state = sampler.start(params_a, PROMPTS, n=1)
    state = sampler.decode(params_a, state)
    out = sampler.result(state)
    for row, f in enumerate(first):
        if f is None:
            assert out.finish_reason[row] == FinishReason.LENGTH and out.lengths[row] == 12
        else:
            assert out.finish_reason[row] == FinishReason.STOP and out.lengths[row] == f + 1
            assert out.completion_mask[row].sum() == f + 1 and not out.truncated[row]
            assert (out.completion_tokens[row, f + 1 :] == 0).all()
    np.testing.assert_array_equal(
        np.where(out.completion_mask, out.completion_tokens, 0),
        np.where(out.completion_mask, free.completion_tokens, 0),
    )
    if all(f is not None for f in first):  # the loop stopped once every row was done
        assert int(state.step) == max(first) + 1


def test_ignore_eos_decodes_every_row_to_the_limit(params_a):
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12, length_bucket=8, max_prompt_len=16)
    free = Sampler(SPEC, cfg, pad_id=0).generate(params_a, PROMPTS, n=1)
    stop = int(free.completion_tokens[0, 2])  # an id row 0 emits: it would stop there
    forced = dataclasses.replace(cfg, ignore_eos=True)
    out = Sampler(SPEC, forced, pad_id=0, eos_id=stop).generate(params_a, PROMPTS, n=1)
    assert (out.lengths == 12).all() and (out.finish_reason == FinishReason.LENGTH).all()
    np.testing.assert_array_equal(out.completion_tokens, free.completion_tokens)
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingConfig(ignore_eos=True, stop_token_ids=[2])


def test_forced_interruption_with_model(params_a):
    inject = [5, 6, 7]
    cfg = SamplingConfig(
        temperature=1.0,
        max_new_tokens=14,
        length_bucket=8,
        max_prompt_len=16,
        length_control="interrupt",
        interrupt_lo=2,
        interrupt_hi=5,
        answer_budget=3,
    )
    sampler = Sampler(SPEC, cfg, pad_id=0, interrupt_ids=inject)
    out = sampler.generate(params_a, PROMPTS, n=4, seed=2)
    seen = set()
    for r in range(out.num_rows):
        inj = np.flatnonzero(out.injected_mask[r])
        assert out.finish_reason[r] == FinishReason.INTERRUPTED  # no stop tokens configured
        at = int(inj[0])
        seen.add(at)
        assert 2 <= at <= 5 and list(inj) == list(range(at, at + 3))
        assert out.completion_tokens[r, at : at + 3].tolist() == inject
        assert out.lengths[r] == at + 3 + 3 and out.truncated[r]
        assert out.completion_mask[r].sum() == at + 3 and not out.completion_mask[r, inj].any()
    assert len(seen) > 1  # placement is drawn per row
    ref = _trainer_logprobs(SPEC, params_a, out, 1.0)
    m = out.completion_mask
    np.testing.assert_allclose(out.logprobs[m], ref[m], atol=1e-5)


def test_sampler_errors():
    cfg = SamplingConfig(
        length_control="interrupt",
        interrupt_lo=4,
        interrupt_hi=8,
        answer_budget=4,
        max_new_tokens=12,
    )
    with pytest.raises(ValueError, match="interrupt_ids"):
        Sampler(SPEC, cfg)
    with pytest.raises(ValueError, match="max_new_tokens=12"):
        Sampler(SPEC, cfg, interrupt_ids=[1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler(SPEC, SamplingConfig(stop_token_ids=[SPEC.vocab_size]))
