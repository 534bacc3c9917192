"""Sampling on a small random model, one batch on the engine (a slot per row, decoded
to the end: `Engine.for_batch`) against the model itself: greedy tokens are the full
forward's argmax, log-probs the trainer's, on one device and eight, with every decode
path (the CPU kernels, XLA's paged reference in one pass or in blocks), across a weight
swap, with stops and forced interruption. tests/test_engine.py checks that the slot
count and refill order change nothing."""

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
from rl_jax.sampling import Engine, FinishReason, logprob_temperature
from rl_jax.sharding import get_rules, make_mesh

SPEC_CONFIG = ModelConfig(
    preset="tiny",
    num_layers=2,
    hidden_size=64,
    intermediate_size=96,
    num_heads=4,
    num_kv_heads=2,
)
SPEC = resolve_spec(SPEC_CONFIG)
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


def sample(params, prompts, cfg, *, n=1, spec=SPEC, mesh=None, engine=None, **run):
    """n rollouts of every prompt on an engine with a slot for each row (`engine`: the
    other `Engine.for_batch` arguments), in one chunk unless `cfg.decode_chunk`. One
    engine per shape and decode path (`_decode_choices`): its programs compile once."""
    engine = engine or {}
    key = repr((spec, cfg, len(prompts), n, mesh, sorted(engine.items()), _decode_choices()))
    if key not in _ENGINES:
        _ENGINES[key] = Engine.for_batch(
            spec,
            cfg,
            prompts=len(prompts),
            n=n,
            prompt_len=cfg.max_prompt_len,
            mesh=mesh,
            pad_id=0,
            **engine,
        )
    return _ENGINES[key].run(params, prompts, n=n, **run)[0]


_ENGINES: dict[str, Engine] = {}


def _decode_choices() -> tuple:
    """What an engine's decode step is traced with (`_decode_path` sets them)."""
    from rl_jax.kernels import xla

    return (
        Engine.platform_attention,
        Engine.platform_matmul,
        xla.DECODE_BLOCK_MIN_SLOTS,
        xla.DECODE_BLOCKS,
        xla.DECODE_BLOCK_PLATFORMS,
    )


GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12, length_bucket=8, max_prompt_len=16)


def test_greedy_equals_argmax_of_full_forward(params_a):
    out = sample(params_a, PROMPTS, GREEDY, n=2)
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


SAMPLED = SamplingConfig(
    temperature=0.7, top_k=20, max_new_tokens=10, length_bucket=8, max_prompt_len=16
)


@pytest.mark.parametrize("fp32_lm_head", [False, True])
def test_logprobs_match_trainer_recomputation(params_a, fp32_lm_head):
    spec = SPEC.replace(fp32_lm_head=fp32_lm_head)
    out = sample(params_a, PROMPTS[:2], SAMPLED, n=3, spec=spec, seed=4, version=5)
    assert len(set(map(tuple, out.completion_tokens[:3]))) > 1  # samples differ
    ref = _trainer_logprobs(spec, params_a, out, logprob_temperature(SAMPLED.temperature))
    m = out.completion_mask
    np.testing.assert_allclose(out.logprobs[m], ref[m], atol=1e-5)
    assert (out.versions[m] == 5).all() and (out.versions[~m] == -1).all()


def test_bfloat16_sampling_matches_trainer_recomputation(params_a):
    """bf16 weights and activations on CPU: the 8-token prompts reach attention layouts whose
    bf16 x bf16 -> f32 dot XLA:CPU's generic kernel lacks (it raised before einsum_f32)."""
    spec = SPEC.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    params = {k: v.astype(jnp.bfloat16) for k, v in params_a.items()}
    prompts = [list(range(3, 11)), list(range(20, 28))]
    out = sample(params, prompts, SAMPLED, n=2, spec=spec, seed=1)
    assert (out.lengths == SAMPLED.max_new_tokens).all()
    ref = _trainer_logprobs(spec, params, out, logprob_temperature(SAMPLED.temperature))
    m = out.completion_mask
    assert np.isfinite(out.logprobs[m]).all() and (out.logprobs[m] <= 0).all()
    # bf16 rounds the two computations' different orders of operations differently.
    np.testing.assert_allclose(out.logprobs[m], ref[m], atol=0.25)
    assert np.abs(out.logprobs[m] - ref[m]).mean() < 0.05


@pytest.mark.devices(8)
def test_same_rows_on_one_and_eight_devices(params_a):
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    key = jax.random.key(11)
    a = sample(params_a, PROMPTS[:2], SAMPLED, n=3, key=key)
    eight = Engine.for_batch(SPEC, SAMPLED, prompts=2, n=3, prompt_len=16, mesh=mesh, pad_id=0)
    b, _ = eight.run(eight.reshard(params_a), PROMPTS[:2], n=3, key=key)  # 6 rows, 8 slots
    assert b.num_rows == 6 and eight.slots == 8
    np.testing.assert_array_equal(a.completion_tokens, b.completion_tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    # A row's draws depend on its id, not its place in the batch.
    c = sample(params_a, PROMPTS[1:2], SAMPLED, n=3, key=key, row_ids=[3, 4, 5])
    np.testing.assert_array_equal(c.completion_tokens, a.completion_tokens[3:])


@pytest.mark.devices(8)
def test_trainer_layout_weights_on_a_data_fsdp_mesh(params_a):
    """FSDP-sharded weights (the trainer's layout) are used as they are; rows split
    over data x fsdp; the draws equal one device's."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
    train_layout = param_shardings(SPEC, mesh, get_rules("fsdp", purpose="train"))
    params = jax.device_put(params_a, train_layout)
    assert "fsdp" in str(params["gate"].sharding.spec)
    key = jax.random.key(11)
    sharded = sample(params, PROMPTS[:2], SAMPLED, n=3, mesh=mesh, key=key)
    one = sample(params_a, PROMPTS[:2], SAMPLED, n=3, key=key)
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


def _decode_path(monkeypatch, path: str) -> None:
    """The engine's decode step as `path`: "kernels" (the platform's, the CPU kernels
    here), "xla" (XLA's paged reference, every page of a row's table in one pass) or
    "blocked" (XLA's reference in blocks of pages up to the furthest row's, an online
    softmax, as long caches on CPU are read)."""
    from rl_jax.kernels import xla

    if path == "kernels":
        from rl_jax.kernels import cpu

        if jax.devices()[0].platform != "cpu" or not cpu.available():
            pytest.skip("the CPU decode kernels cannot be built here (no C++ compiler)")
        return
    monkeypatch.setattr(Engine, "platform_attention", False)
    monkeypatch.setattr(Engine, "platform_matmul", False)
    if path == "blocked":
        monkeypatch.setattr(xla, "DECODE_BLOCK_MIN_SLOTS", 8)
        monkeypatch.setattr(xla, "DECODE_BLOCKS", 4)
        monkeypatch.setattr(xla, "DECODE_BLOCK_PLATFORMS", (jax.devices()[0].platform,))


@pytest.mark.devices(8)
@pytest.mark.parametrize("path", ["kernels", "xla", "blocked"])
def test_every_decode_path_decodes_as_the_model(path, mild_params, monkeypatch):
    """Greedy tokens are the full forward's argmax and sampled log-probs the trainer's
    within 1e-5, on one device and on eight, and across a weight swap between decode
    chunks the model's own cached forward (A writes the cache, B continues). Pages of 16
    positions: a row spans four; a 2-token prompt beside a 20-token one leaves the
    short row's first page wholly padding."""
    _decode_path(monkeypatch, path)
    params_a, params_b = mild_params
    prompts = [[5, 6], list(range(3, 23))]
    paged = {"page_size": 16}
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=40, length_bucket=8, max_prompt_len=24)
    out = sample(params_a, prompts, greedy, n=2, engine=paged)
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
    got = sample(params_a, prompts, cfg, n=3, key=key, engine=paged)
    ref = _trainer_logprobs(SPEC, params_a, got, logprob_temperature(0.7))
    np.testing.assert_allclose(got.logprobs, ref, atol=1e-5)
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    eight = Engine.for_batch(
        SPEC, cfg, prompts=2, n=3, prompt_len=24, mesh=mesh, pad_id=0, page_size=16
    )
    on_eight, _ = eight.run(eight.reshard(params_a), prompts, n=3, key=key)
    np.testing.assert_array_equal(on_eight.completion_tokens, got.completion_tokens)
    np.testing.assert_allclose(on_eight.logprobs, got.logprobs, atol=1e-5)

    k = 5  # chunk 0 under A (version 1), the rest under B on the cache A wrote
    swap = dataclasses.replace(greedy, decode_chunk=k)
    out = sample(
        params_a,
        prompts,
        swap,
        n=1,
        engine=paged,
        weights=lambda chunk: (params_a, 1) if chunk == 0 else (params_b, 2),
    )
    assert (out.versions[:, :k] == 1).all() and (out.versions[:, k:] == 2).all()
    logits = _swapped_logits(params_a, params_b, *_sequences(out), tp + k - 1)
    logits = np.asarray(logits)[:, : 40 - k]  # predictions of completion k .. 39
    np.testing.assert_array_equal(logits.argmax(-1), out.completion_tokens[:, k:])
    ref = np.take_along_axis(
        np.asarray(jax.nn.log_softmax(logits)), out.completion_tokens[:, k:, None], -1
    )[..., 0]
    np.testing.assert_allclose(out.logprobs[:, k:], ref, atol=1e-5)
    # The swap mattered: A alone continues otherwise.
    only_a = sample(params_a, prompts, greedy, n=1, engine=paged)
    assert (only_a.completion_tokens[:, k:] != out.completion_tokens[:, k:]).any()


@pytest.mark.parametrize("path", ["kernels", "xla"])
def test_q_k_norms_decode_as_the_model(path, monkeypatch):
    """A model with q/k norms (Qwen3): the decode step normalizes and rotates queries and
    keys as the model's forward does (`norm_rope_qk`), with the CPU kernels (which then
    take q, k and v rotated) and with XLA's reference: greedy tokens are the full
    forward's argmax, their log-probs its log-softmax within 1e-5."""
    _decode_path(monkeypatch, path)
    spec = resolve_spec(dataclasses.replace(SPEC_CONFIG, architecture="qwen3"))
    assert spec.qk_norm and not spec.qkv_bias
    params = init_params(spec, jax.random.key(2))
    norms = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm")
    params = {k: v if k in norms else v * 3.0 for k, v in params.items()}
    out = sample(params, PROMPTS, GREEDY, spec=spec)
    assert (out.lengths == GREEDY.max_new_tokens).all()
    tokens, valid, positions = _sequences(out)

    @jax.jit
    def logits(params):
        model = Transformer(spec, params)
        return model.logits(model(tokens, positions, kv_valid_bs=valid)[0])

    tp, m = out.prompt_tokens.shape[1], out.completion_mask
    want = np.asarray(jax.nn.log_softmax(logits(params)[:, tp - 1 : -1]))
    np.testing.assert_array_equal(want.argmax(-1)[m], out.completion_tokens[m])
    want = np.take_along_axis(want, out.completion_tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out.logprobs[m], want[m], atol=1e-5)


def test_stop_tokens_end_rows_early(params_a):
    free = sample(params_a, PROMPTS, GREEDY)
    stop = int(free.completion_tokens[0, 2])
    first = [
        int(np.argmax(r == stop)) if (r == stop).any() else None for r in free.completion_tokens
    ]
    out = sample(params_a, PROMPTS, GREEDY, engine={"eos_id": stop})
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


def test_ignore_eos_decodes_every_row_to_the_limit(params_a):
    free = sample(params_a, PROMPTS, GREEDY)
    stop = int(free.completion_tokens[0, 2])  # an id row 0 emits: it would stop there
    forced = dataclasses.replace(GREEDY, ignore_eos=True)
    out = sample(params_a, PROMPTS, forced, engine={"eos_id": stop})
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
    out = sample(params_a, PROMPTS, cfg, n=4, seed=2, engine={"interrupt_ids": inject})
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
        Engine(SPEC, cfg, slots=1)
    with pytest.raises(ValueError, match="max_new_tokens=12"):
        Engine(SPEC, cfg, slots=1, interrupt_ids=[1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Engine(SPEC, SamplingConfig(stop_token_ids=[SPEC.vocab_size]), slots=1)
