"""Core decoder: specs, FLOPs, forward/cache/packing/padding, chunked log-probs, sharding."""

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.config import ConfigError, MeshConfig, ModelConfig
from rl_jax.kernels import xla
from rl_jax.models import (
    PRESETS,
    Transformer,
    build_model,
    init_params,
    layers,
    logprobs_from_logits,
    model_params,
    positions_from_valid,
    resolve_spec,
    token_logprobs,
)
from rl_jax.models.spec import RopeScaling
from rl_jax.sharding import make_mesh

SMALL = dict(
    preset="",
    architecture="qwen2",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=10000.0,
)


def small_spec(**kw):
    return resolve_spec(ModelConfig(**{**SMALL, **kw}))


def tokens(B, T, V, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


@nnx.jit(static_argnames=("chunk",))
def _logprobs(model, toks, chunk=0):
    return token_logprobs(model, toks, chunk=chunk)


@nnx.jit
def _full_logits(model, toks):
    return model.logits(model(toks)[0])


@nnx.jit
def _hidden(model, toks, pos, seg, valid):
    return model(toks, pos, segment_ids_bt=seg, kv_valid_bs=valid)[0]


# One spec and model for the forward tests (compiles are the cost of this file):
# Qwen3 layout (q/k norms), untied head.
SPEC = small_spec(architecture="qwen3", tie_embeddings="false")
TOKS = tokens(4, 11, SPEC.vocab_size, seed=1)  # B = 4: one row per batch shard on 8 devices


@pytest.fixture(scope="module")
def model():
    return build_model(SPEC, seed=1)


def right_padded(rows, T):
    """Rows padded on the right: causal outputs of a row's own positions are unaffected."""
    out = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return jnp.asarray(out)


# ---- specs and presets -----------------------------------------------------------------


def test_presets_resolve_with_overrides():
    bench = resolve_spec(ModelConfig(preset="bench"))
    assert (bench.architecture, bench.vocab_size, bench.hidden_size) == ("qwen2", 512, 256)
    assert (bench.intermediate_size, bench.num_layers, bench.num_heads) == (688, 4, 4)
    assert (bench.num_kv_heads, bench.head_dim, bench.tie_embeddings) == (2, 64, False)
    assert bench.qkv_bias and not bench.qk_norm and bench.rope_theta == 10000.0
    q3 = resolve_spec(ModelConfig(preset="qwen3-0.6b", num_layers=2, fp32_lm_head=True))
    assert q3.head_dim == 128 and q3.qk_norm and q3.num_layers == 2 and q3.fp32_lm_head
    ll = resolve_spec(ModelConfig(preset="llama3.2-1b"))
    assert ll.rope_scaling is not None and ll.rope_scaling.factor == 32.0
    tiny = resolve_spec(ModelConfig(preset="tiny", num_heads=8, tie_embeddings="false"))
    assert tiny.head_dim == 128 // 8 and not tiny.tie_embeddings
    for name in PRESETS:
        assert resolve_spec(ModelConfig(preset=name)).num_params() > 0


def test_spec_errors_name_the_problem():
    with pytest.raises(ConfigError, match="model.preset='nope'.*bench"):
        resolve_spec(ModelConfig(preset="nope"))
    with pytest.raises(ConfigError, match="lacks.*vocab_size"):
        resolve_spec(ModelConfig(preset="", hidden_size=8))
    with pytest.raises(ConfigError, match="num_kv_heads=3"):
        resolve_spec(ModelConfig(preset="tiny", num_kv_heads=3))
    with pytest.raises(ConfigError, match="model.architecture='gpt2'"):
        ModelConfig(architecture="gpt2")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"num_heads": 8, "num_kv_heads": 3}, "model.num_heads=8 must be a multiple of"),
        ({"head_dim": 7}, "model.head_dim=7 must be even"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5 must be in"),
        ({"attention_block": 0}, "model.attention_block=0 must be in"),
    ],
)
def test_config_and_spec_are_checked_by_one_validator(fields, message):
    """A pair of fields no preset can repair is refused by the config itself (before any
    checkpoint is read), with the message the resolved spec gives for it."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig(preset="tiny", **fields)
    spec = resolve_spec(ModelConfig(preset="tiny-moe"))
    with pytest.raises(ConfigError, match=message):
        spec.replace(**fields)
    # Zeros are "from the preset" in a config and refused in a spec.
    ModelConfig(hidden_size=0)
    with pytest.raises(ConfigError, match="model.hidden_size=0 must be > 0"):
        spec.replace(hidden_size=0)


def test_flops_formula():
    s = resolve_spec(ModelConfig(preset="bench"))
    D, F, H, K, hd, L, V = 256, 688, 4, 2, 64, 4, 512
    per_layer = D * H * hd + 2 * D * K * hd + H * hd * D + 3 * D * F
    assert s.flops_per_token(100) == 2 * (L * per_layer + V * D) + 4 * L * H * hd * 100
    assert s.train_flops_per_token(7) == 3 * s.flops_per_token(7)
    T = 13
    by_token = sum(s.flops_per_token(t + 1) for t in range(T))
    assert s.sequence_flops(T) == pytest.approx(by_token, rel=1e-12)
    assert s.sequence_flops(T, train=True) == pytest.approx(3 * by_token, rel=1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_num_params_counts_every_array(arch):
    spec = small_spec(architecture=arch, value_head=True)
    shapes = jax.eval_shape(lambda k: init_params(spec, k), jax.random.key(0))
    assert sum(int(np.prod(a.shape)) for a in shapes.values()) == spec.num_params()


# ---- forward semantics ------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, "llama3"])
def test_rope_table_equals_direct_angles(scaling):
    """The table read (rope_table) gives the same bits as computing cos and sin at
    each position, with and without Llama 3.1 frequency scaling; a position past the
    table reads its last row."""
    kw = dict(architecture="llama", rope_theta=500000.0) if scaling else {}
    spec = small_spec(**kw)
    if scaling:
        spec = dataclasses.replace(
            spec,
            rope_scaling=RopeScaling(
                factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8
            ),
        )
    pos = jnp.array([[0, 1, 5, 37, 63], [7, 7, 0, 2, 62]], jnp.int32)
    want = jax.jit(lambda p: layers.rope_angles(p, spec))(pos)
    table = layers.rope_table(spec, 64)
    got = jax.jit(lambda p, t: layers.rope_angles(p, spec, table=t))(pos, table)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape == (2, 5, spec.head_dim // 2)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    past = layers.rope_angles(jnp.array([[70]]), spec, table=table)[0]
    np.testing.assert_array_equal(past, layers.rope_angles(jnp.array([[63]]), spec)[0])


def test_logprobs_match_full_softmax_and_chunking(model):
    logp, ent = _logprobs(model, TOKS)
    full = np.asarray(jax.nn.log_softmax(_full_logits(model, TOKS), axis=-1))  # [B, T, V]
    toks = np.asarray(TOKS)
    want = np.take_along_axis(full[:, :-1], toks[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(logp[:, :-1], want, atol=1e-6)
    want_ent = -(np.exp(full) * full).sum(-1)
    np.testing.assert_allclose(ent[:, :-1], want_ent[:, :-1], atol=1e-5)
    assert np.all(logp[:, -1] == 0) and np.all(ent[:, -1] == 0)
    # T = 11 is not a multiple of 4: the padded tail must not leak in.
    logp4, ent4 = _logprobs(model, TOKS, chunk=4)
    np.testing.assert_allclose(logp4, logp, atol=1e-6)
    np.testing.assert_allclose(ent4, ent, atol=1e-6)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_chunked_scanned_rematerialized_gradient_equals_plain(model, remat):
    """Chunked log-probs, scan over layers, remat policies and blockwise attention change
    memory/compile time, not math."""
    other = build_model(
        dataclasses.replace(
            SPEC, scan_layers=True, remat=remat, attention="blockwise", attention_block=4
        ),
        params=model_params(model),
    )

    @nnx.jit(static_argnames=("chunk",))
    def loss_and_grads(m, chunk):
        def loss(m):
            lp, ent = token_logprobs(m, TOKS, chunk=chunk)
            return lp.sum() + 0.1 * ent.sum()

        return nnx.value_and_grad(loss)(m)

    (l0, g0), (l3, g3) = loss_and_grads(model, 0), loss_and_grads(other, 3)
    np.testing.assert_allclose(l3, l0, rtol=1e-6)
    flat0 = model_params(nnx.merge(nnx.graphdef(model), g0))
    flat3 = model_params(nnx.merge(nnx.graphdef(other), g3))
    for name in flat0:  # whole-model gradients summed over 44 tokens: whole-model tolerance
        np.testing.assert_allclose(flat3[name], flat0[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_scan_layers_chooses_a_rolled_or_an_unrolled_layer_loop(model):
    """model.scan_layers=true: the forward's layers are one `scan` of L iterations, both
    in the forward and the backward; false: no loop at all, every layer in the program."""

    def loops(m):
        def loss(params):
            out = Transformer(m.spec, params)(TOKS)[0]
            return out.sum()

        jaxpr = jax.make_jaxpr(jax.grad(loss))(model_params(m))
        return [e.params["length"] for e in _equations(jaxpr.jaxpr) if e.primitive.name == "scan"]

    rolled = build_model(SPEC.replace(scan_layers=True), params=model_params(model))
    assert loops(rolled) == [SPEC.num_layers] * 2
    assert loops(model) == []


def test_scan_layers_auto_rolls_the_loop_of_deep_models_only():
    from rl_jax.models.spec import SCAN_FROM_LAYERS

    def rolled(layers, knob="auto"):
        return small_spec(num_layers=layers, scan_layers=knob).scan_layers

    assert rolled(SCAN_FROM_LAYERS) and not rolled(SCAN_FROM_LAYERS - 1)
    assert rolled(2, True) and not rolled(SCAN_FROM_LAYERS, False)
    assert resolve_spec(ModelConfig(preset="qwen3-8b")).scan_layers
    assert small_spec(scan_layers="FALSE").scan_layers is False
    with pytest.raises(ConfigError, match="model.scan_layers='maybe': must be true, false"):
        small_spec(scan_layers="maybe")


def _equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _equations(sub)


def test_blockwise_attention_equals_dense_in_the_model(model):
    """model.attention=blockwise (block 4 of T = 11) computes the dense forward's numbers:
    packed segments and left padding included."""
    seg = jnp.asarray([[0] * 5 + [1] * 6] * 4)
    valid = jnp.asarray(np.arange(11)[None] >= np.array([[0], [2], [0], [1]]))
    pos = positions_from_valid(valid)
    blockwise = build_model(
        SPEC.replace(attention="blockwise", attention_block=4), params=model_params(model)
    )
    want = _hidden(model, TOKS, pos, seg, valid)
    got = _hidden(blockwise, TOKS, pos, seg, valid)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_remat_and_attention_knobs():
    assert small_spec(remat=True).remat == "full" and small_spec(remat="False").remat == "none"
    with pytest.raises(ConfigError, match="model.remat"):
        small_spec(remat="some")
    with pytest.raises(ConfigError, match="model.attention="):
        small_spec(attention="flash")
    # auto: dense up to 1024 keys (the tiny recipes' numbers stay bit-identical).
    from rl_jax.models.transformer import uses_blockwise

    assert not uses_blockwise(SPEC, 1024) and uses_blockwise(SPEC, 1025)
    assert uses_blockwise(SPEC.replace(attention="blockwise"), 8)
    assert not uses_blockwise(SPEC.replace(attention="dense"), 10**6)


def test_auto_logprob_chunks_only_big_logits():
    from rl_jax.models.logprobs import chunk_size

    assert chunk_size(-1, 256, 512) == 0  # the tiny preset: one piece, as before
    assert chunk_size(-1, 1024, 151936) == 96  # 2**24 // 151936 = 110, to a multiple of 16
    assert chunk_size(-1, 1024, 2**21) == 8  # under 16 steps: as many as fit
    assert chunk_size(0, 10**5, 151936) == 0 and chunk_size(16, 11, 48) == 0
    assert chunk_size(4, 11, 48) == 4


def test_chunked_logprob_gradient_never_holds_the_whole_logits():
    """The backward of chunked log-probs recomputes each chunk's logits: its scratch
    memory is a chunk's [B, c, V] float32 blocks, not the whole [B, T, V] ones."""
    from rl_jax.models import logprobs_from_hidden

    spec = small_spec(vocab_size=4096)
    params = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init_params(spec, jax.random.key(0))
    )
    B, T = 2, 1024
    hidden = jax.ShapeDtypeStruct((B, T, spec.hidden_size), jnp.float32)
    targets = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def temporaries(chunk):
        def loss(p, h, t):
            logp, ent = logprobs_from_hidden(Transformer(spec, p), h, t, chunk=chunk)
            return logp.sum() + ent.sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return grad.lower(params, hidden, targets).compile().memory_analysis().temp_size_in_bytes

    # Measured: 135 MB whole (4 x 32 MB of logits), 9 MB in chunks of 64 (2 MB each).
    logits, chunk_logits = (B * t * spec.vocab_size * 4 for t in (T, 64))
    whole, chunked = temporaries(0), temporaries(64)
    assert whole >= 2 * logits and chunked < 5 * chunk_logits, (whole, chunked)


def test_temperature_divides_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32) * 3
    tgt = np.array([[1, 2, 3], [4, 5, 6]])
    lp, ent = jax.jit(logprobs_from_logits)(logits, tgt, 0.7)
    z = logits / 0.7
    ref = (
        z
        - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - z.max(-1, keepdims=True)
    )
    np.testing.assert_allclose(lp, np.take_along_axis(ref, tgt[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(ent, -(np.exp(ref) * ref).sum(-1), atol=1e-5)


@nnx.jit(static_argnames=("n_prompt", "spare"))
def _prefill_decode(model, toks, valid, n_prompt, spare=3):
    """Prefill a left-padded prompt, then decode the rest one token at a time."""
    B, T = toks.shape
    pos = positions_from_valid(valid)
    cache = model.init_cache(B, T + spare)
    kv_valid = jnp.pad(valid, ((0, 0), (0, spare)))
    h, cache = model(
        toks[:, :n_prompt], pos[:, :n_prompt], kv_valid_bs=kv_valid, cache=cache, cache_index=0
    )
    outs = [h]
    for t in range(n_prompt, T):  # small static loop: the test model is 2 layers
        h, cache = model(
            toks[:, t : t + 1], pos[:, t : t + 1], kv_valid_bs=kv_valid, cache=cache, cache_index=t
        )
        outs.append(h)
    return model.logits(jnp.concatenate(outs, axis=1)), cache


def test_cache_prefill_decode_left_padding_matches_unpadded_rows(model):
    V = SPEC.vocab_size
    row0 = np.asarray(tokens(1, 8, V, seed=7))[0]
    row1 = np.asarray(tokens(1, 6, V, seed=8))[0]
    toks = np.stack([row0, np.concatenate([[0, 0], row1])])  # row 1 left-padded by 2
    valid = np.array([[1] * 8, [0, 0] + [1] * 6], bool)
    logits, cache = _prefill_decode(model, jnp.asarray(toks), jnp.asarray(valid), 5)
    alone = _full_logits(model, right_padded([row0, row1], 8))
    for b, row in ((0, row0), (1, row1)):
        got = np.asarray(logits[b, 8 - len(row) :])
        np.testing.assert_allclose(got, alone[b, : len(row)], atol=1e-5)
    # the cache re-orders along batch (the sampler repeats each prompt G times)
    rep = cache.repeat(3)
    assert rep.batch_size == 6 and rep.max_len == 11 and len(rep.k) == SPEC.num_layers
    np.testing.assert_array_equal(rep.k[1][4], cache.k[1][1])
    np.testing.assert_array_equal(cache.take(jnp.array([1, 0])).v[0][0], cache.v[0][1])


def test_blocked_cache_attention_equals_whole_cache(model, monkeypatch):
    """Large caches are read block by block (online softmax) up to the filled slot."""
    toks = tokens(2, 24, SPEC.vocab_size, seed=18)
    valid = jnp.asarray(np.array([[1] * 24, [0] * 3 + [1] * 21], bool))
    # prefill 20 tokens (2 blocks), then 4 decode steps into the second block
    whole, _ = _prefill_decode(model, toks, valid, 20, spare=40)  # S = 64, one block
    monkeypatch.setattr(xla, "CACHE_BLOCK_BYTES", 1)  # 16-slot blocks: 4 blocks
    assert xla.cache_block_size(2, 2, 64, 8, 4) == 16
    blocked, _ = nnx.jit(_prefill_decode.__wrapped__, static_argnames=("n_prompt", "spare"))(
        model, toks, valid, 20, spare=40
    )
    real = np.asarray(valid)  # pad queries see no key at all: their outputs are arbitrary
    np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(whole)[real], atol=1e-5)


def test_packed_segments_equal_separate_rows(model):
    a = np.asarray(tokens(1, 5, SPEC.vocab_size, seed=10))[0]
    b = np.asarray(tokens(1, 4, SPEC.vocab_size, seed=11))[0]
    packed = jnp.asarray(np.stack([np.concatenate([a, b]), np.concatenate([b, a])]))
    seg = jnp.asarray([[1] * 5 + [2] * 4, [1] * 4 + [2] * 5])
    pos = jnp.asarray([list(range(5)) + list(range(4)), list(range(4)) + list(range(5))])
    h = _hidden(model, packed, pos, seg, None)
    alone = _hidden(model, right_padded([a, b], 9), None, None, None)
    np.testing.assert_allclose(h[0, :5], alone[0, :5], atol=1e-5)
    np.testing.assert_allclose(h[0, 5:], alone[1, :4], atol=1e-5)
    np.testing.assert_allclose(h[1, 4:], alone[0, :5], atol=1e-5)


def test_decode_step_compiles_once_across_cache_index(model):
    cache = model.init_cache(2, 8)
    traces = []

    @nnx.jit
    def step(m, tok, cache, i):
        traces.append(1)
        h, cache = m(tok, jnp.full(tok.shape, i), cache=cache, cache_index=i)
        return m.logits(h), cache

    tok = jnp.zeros((2, 1), jnp.int32)
    for i in range(3):
        _, cache = step(model, tok, cache, jnp.int32(i))
    assert len(traces) == 1
    k0 = np.asarray(cache.k[0])  # [B, K, S, hd]: slots 0..2 written, the rest untouched
    assert np.abs(k0[:, :, 2]).sum() > 0 and np.abs(k0[:, :, 3:]).sum() == 0


# ---- precision and heads -------------------------------------------------------------------


def test_bf16_and_fp32_lm_head_track_float32(model):
    want = _logprobs(model, TOKS)[0]
    params = {k: v.astype(jnp.bfloat16) for k, v in model_params(model).items()}
    for fp32_head in (False, True):
        bf = dataclasses.replace(
            SPEC, param_dtype="bfloat16", compute_dtype="bfloat16", fp32_lm_head=fp32_head
        )
        m = build_model(bf, params=params)
        got = _logprobs(m, TOKS)[0]
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
        h = jax.eval_shape(lambda t, m=m: m(t)[0], TOKS)
        final = jax.eval_shape(m.final_hidden, h)
        assert h.dtype == jnp.bfloat16
        assert final.dtype == (jnp.float32 if fp32_head else jnp.bfloat16)


def test_value_head_is_linear_in_final_hidden(model):
    spec = dataclasses.replace(SPEC, value_head=True)
    params = model_params(model)
    params["value_w"] = jax.random.normal(jax.random.key(1), (spec.hidden_size,))
    params["value_b"] = jnp.float32(0.25)
    with_head = build_model(spec, params=params)

    @nnx.jit
    def heads(m, toks):
        h = m(toks)[0]
        return m.values(h), m.final_hidden(h)

    vals, final = heads(with_head, TOKS)
    assert vals.shape == TOKS.shape
    np.testing.assert_allclose(vals, final @ params["value_w"] + 0.25, atol=1e-5)


# ---- sharding ------------------------------------------------------------------------------


@pytest.mark.devices(8)
def test_eight_devices_match_one(model):
    want = np.asarray(_logprobs(model, TOKS)[0])
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    many = build_model(SPEC, mesh=mesh, rules_preset="fsdp_tp", seed=1)
    q = many.layers.q[...]
    assert len(q.sharding.device_set) == 8
    # initialized in place: each device holds only its (embed/fsdp, heads/tensor) block
    assert q.addressable_shards[0].data.shape == (SPEC.num_layers, 16, 2, 8)
    got = np.asarray(_logprobs(many, TOKS, chunk=4)[0])
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.devices(8)
def test_model_from_replicated_weights_without_a_mesh(model):
    # A data-parallel trainer's weights sit on every device; a Transformer made from
    # them without a mesh (HF export, scoring) keeps them where they are.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(MeshConfig(data=-1, fsdp=1))
    rep = jax.device_put(model_params(model), NamedSharding(mesh, P()))
    copy = Transformer(SPEC, rep)
    assert copy.layers.q[...].sharding.device_set == set(mesh.devices.flat)
    np.testing.assert_allclose(
        np.asarray(_logprobs(copy, TOKS)[0]), np.asarray(_logprobs(model, TOKS)[0]), atol=1e-6
    )


@pytest.mark.parametrize(
    "preset, published",
    [
        # Parameter counts of the released checkpoints (Hugging Face model pages).
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-1.5b", 1_543_714_304),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen3-4b", 4_022_468_096),
        ("qwen3-8b", 8_190_735_360),
        ("qwen3-14b", 14_768_307_200),
        ("qwen3-32b", 32_762_123_264),
        ("llama3.2-1b", 1_235_814_400),
        ("llama3.2-3b", 3_212_749_824),
        ("llama3.1-8b", 8_030_261_248),
    ],
)
def test_real_family_presets_have_the_released_sizes(preset, published):
    from rl_jax.config import load_recipe
    from rl_jax.models.load import resolve_spec

    spec = resolve_spec(load_recipe("scalerl", [f"model.preset={preset}"]).model)
    assert spec.num_params() == published
