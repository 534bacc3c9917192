"""The kernel registry (rl_jax.kernels): platform from the mesh's devices, every op of
a platform against the portable reference (`xla`), and the train step's layer loop
(rolled or unrolled)."""

import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_jax import kernels
from rl_jax.config import LossConfig, ModelConfig
from rl_jax.kernels import cpu, xla
from rl_jax.models import init_params, layers, resolve_spec
from rl_jax.sharding import get_rules
from rl_jax.train.step import assemble_batch, make_update, put_minibatches

ROOT = Path(__file__).resolve().parents[1]


def _fake_mesh(platform: str):
    """Anything with `.devices.flat[0].platform`, as a Mesh of that platform's devices."""
    device = types.SimpleNamespace(platform=platform)
    return types.SimpleNamespace(devices=np.array([device], dtype=object))


def test_platform_comes_from_the_mesh_devices():
    assert kernels.for_mesh(_fake_mesh("tpu")).platform == "tpu"
    assert kernels.for_mesh(_fake_mesh("cpu")).platform == "cpu"
    # The reference for every op TPU and GPU do not register.
    tpu = kernels.for_mesh(_fake_mesh("tpu"))
    assert tpu.einsum_f32 is xla.einsum_f32 and tpu.attention is xla.attention
    assert kernels.for_platform("cpu").einsum_f32 is cpu.einsum_f32
    assert kernels.for_mesh(None).platform == jax.devices()[0].platform


def test_decode_ops_are_the_platforms_where_its_kernels_apply():
    """The decode step's ops: XLA's where no platform kernels apply (long page tables
    read in blocks on CPU), on TPU the Pallas paged attention's (pages of whole
    bfloat16 tiles); on CPU the C++ kernels in float32 where each device decodes
    alone, attention with head widths in whole key tiles (its pages' keys in tiles)."""
    from rl_jax.kernels import tpu as tpu_kernels

    cond = dict(compute_dtype="float32", head_dim=64, local=True, threads=True)
    geometry = dict(kv_heads=2, layers=3, pages=5, page=32, head_dim=64, dtype="float32")
    tpu = kernels.for_platform("tpu").decode_ops(**cond)
    assert type(tpu) is tpu_kernels.Decode and tpu.platform_ops == ()
    assert (tpu.page_size, tpu.page_multiple) == (64, 16)
    assert type(kernels.for_platform("gpu").decode_ops(**cond)) is xla.Decode
    on_cpu = kernels.for_platform("cpu")
    for off in ({"compute_dtype": "bfloat16"}, {"local": False}):
        plain = on_cpu.decode_ops(**{**cond, **off})
        assert plain.platform_ops == () and plain.platform == "cpu" and plain.page_multiple == 1
        assert plain.paged_shapes(**geometry).keys.shape == (2, 3, 5, 32, 64)
        assert plain.einsum is cpu.einsum_f32
    if not cpu.available():
        return
    both = on_cpu.decode_ops(**cond)
    assert both.platform_ops == ("attention", "matmul") and both.page_multiple == cpu.KEY_TILE
    assert both.paged_shapes(**geometry).keys.shape == (2, 3, 5, 2, 64, cpu.KEY_TILE)
    assert on_cpu.decode_ops(**{**cond, "head_dim": 24}).platform_ops == ("matmul",)
    assert on_cpu.decode_ops(**cond, attention=False).platform_ops == ("matmul",)
    assert on_cpu.decode_ops(**cond, matmul=False).platform_ops == ("attention",)


def test_unknown_platform_or_op_names_the_known_ones():
    with pytest.raises(ValueError, match="known: xla, cpu, gpu, tpu"):
        kernels.for_platform("npu")
    with pytest.raises(ValueError, match="known: attention, attention_cached, dense"):
        kernels.register("cpu", flash=xla.attention)


def test_registered_op_replaces_the_reference_on_its_platform_only(monkeypatch):
    monkeypatch.setattr(kernels, "_REGISTRY", {p: dict(o) for p, o in kernels._REGISTRY.items()})
    kernels.for_platform.cache_clear()
    try:
        marker = lambda *a, **k: None  # noqa: E731
        kernels.register("tpu", dense=marker)
        assert kernels.for_platform("tpu").dense is marker
        assert kernels.for_platform("gpu").dense is xla.dense
    finally:
        monkeypatch.undo()
        kernels.for_platform.cache_clear()
    assert kernels.for_platform("tpu").dense is xla.dense


def test_no_default_backend_outside_the_registry():
    """Platform choices come from the mesh (a CPU host compiling for TPU gets TPU ops)."""
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "rl_jax").rglob("*.py"))
        if "kernels" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "default_backend" in line
    ]
    assert not hits, hits


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_attention_equals_the_reference(dtype):
    """The cpu ops upcast half precision (XLA:CPU has no bf16 x bf16 -> f32 dot); the
    results match the reference computed in float32."""
    k = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k[0], (2, 5, 4, 8))
    keys = jax.random.normal(k[1], (2, 2, 7, 8))
    values = jax.random.normal(k[2], (2, 2, 7, 8))
    mask = jnp.tril(jnp.ones((5, 7), bool), 2)[None]
    want = xla.attention(q, keys, values, mask, scale=0.3)
    ops = kernels.for_platform("cpu")
    args = (q.astype(dtype), keys.astype(dtype), values.astype(dtype), mask)
    got = jax.jit(lambda *a: ops.attention(*a, scale=0.3))(*args)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol)
    cached = jax.jit(lambda *a: ops.attention_cached(*a, scale=0.3, filled=7))(*args)
    np.testing.assert_allclose(np.asarray(cached, np.float32), want, atol=tol, rtol=tol)


def _train_step_text(num_layers: int, scan_layers: bool) -> str:
    spec = resolve_spec(
        ModelConfig(
            preset="tiny",
            num_layers=num_layers,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            num_kv_heads=2,
            scan_layers=scan_layers,
        )
    )
    params = init_params(spec, jax.random.key(0))
    rows, tp, tg = 4, 8, 8
    zeros = np.zeros((rows, tg), np.float32)
    host = assemble_batch(
        np.ones((rows, tp), np.int32),
        np.ones((rows, tp), bool),
        np.ones((rows, tg), np.int32),
        np.full((rows,), tg, np.int32),
        zeros + 1,
        zeros,
        np.array([1.0, -1.0, 0.5, -0.5], np.float32),
        np.repeat(np.arange(2, dtype=np.int32), 2),
    )
    batch = put_minibatches(host, None, num_minibatches=1, groups=2)
    assert batch.group_size == 2  # the shared-prefix forward
    tx = optax.sgd(1e-3)
    step = make_update(
        spec,
        get_rules("fsdp_tp"),
        None,
        tx,
        LossConfig(name="grpo"),
        num_groups=2,
        max_tokens=tg,
        temperature=1.0,
    )
    return step.lower(params, tx.init(params), batch).as_text()


@pytest.mark.parametrize("scan_layers", [True, False])
def test_train_step_program_grows_with_depth_only_unrolled(scan_layers):
    """model.scan_layers=true: the train step's program does not grow with depth, 2 and 4
    layers lower to the same matmuls (one layer body inside a while loop, forward and
    backward); false: each layer more adds the same matmuls, and no loop but the
    update's over its minibatches."""
    two, three, four = (_train_step_text(n, scan_layers) for n in (2, 3, 4))
    dots = [t.count("stablehlo.dot_general") for t in (two, three, four)]
    if scan_layers:
        assert four.count("stablehlo.while") >= 3
        assert dots[0] == dots[2], dots
    else:
        assert four.count("stablehlo.while") == 1
        assert dots[2] - dots[1] == dots[1] - dots[0] > 0, dots


def _flash_case(case: str):
    """q [2, T, 4, 8] over keys [2, 2, S, 8] (grouped-query: 2 query heads per kv head) and
    the mask of `case`, described and dense: causal; left and right padding with pad
    queries that see no key; packed segments; T queries at slot offset 5 of S keys (the
    shared-prefix forward's completions). T and S are not multiples of the block, 4."""
    T, S, offset = (7, 12, 5) if case == "offset" else (11, 11, 0)
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (2, T, 4, 8))
    k, v = (jax.random.normal(x, (2, 2, S, 8)) for x in ks[1:3])
    d_out = jax.random.normal(ks[3], q.shape)
    valid = seg = None
    if case in ("padded", "offset"):
        valid = jnp.asarray(np.arange(S)[None] >= np.array([[3], [0]])) & jnp.asarray(
            np.arange(S)[None] < np.array([[S], [S - 2]])
        )
    if case == "packed":
        seg = jnp.asarray([[0] * 4 + [1] * 7, [0] * 9 + [1] * 2])
    dense = layers.attention_mask(
        T, S, cache_index=offset or None, segment_ids_bt=seg, kv_valid_bs=valid
    )
    return q, k, v, d_out, xla.AttentionMask(offset, valid, seg, seg), dense


@pytest.mark.parametrize("case", ["causal", "padded", "packed", "offset"])
def test_flash_attention_equals_dense_in_values_and_gradients(case):
    q, k, v, d_out, mask, dense = _flash_case(case)

    def run(fn):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v) * d_out)

        return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))(q, k, v)

    want, want_g = run(lambda q, k, v: xla.attention(q, k, v, dense, scale=0.3))
    for ops in (kernels.for_platform("xla"), kernels.for_platform("cpu")):
        got, got_g = run(
            lambda q, k, v, ops=ops: ops.flash_attention(q, k, v, mask, scale=0.3, block=4)
        )
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
        for name, g, w in zip("qkv", got_g, want_g, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=name)


def test_flash_attention_temporaries_are_a_block_of_scores():
    """The gradient of blockwise attention over 2,048 keys in blocks of 128 needs far less
    scratch memory than the dense form's [B, H, T, S] scores and probabilities."""
    B, T, H, K, hd = 1, 2048, 4, 2, 16
    q = jax.ShapeDtypeStruct((B, T, H, hd), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, K, T, hd), jnp.float32)
    mask = xla.AttentionMask()

    def temporaries(fn):
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes

    dense = temporaries(lambda q, k, v: xla.attention(q, k, v, mask.block(T, 0, T), scale=0.25))
    blockwise = temporaries(
        lambda q, k, v: xla.flash_attention(q, k, v, mask, scale=0.25, block=128)
    )
    # Measured: dense 202 MB (scores, probabilities, their gradient: 3 x 67 MB),
    # blockwise 18 MB (a block's scores, probabilities and their gradients: 4 x 4 MB).
    scores, block_scores = B * H * T * T * 4, B * H * T * 128 * 4
    assert dense >= 3 * scores and blockwise < 5 * block_scores, (dense, blockwise)


def test_flash_attention_computes_only_the_causal_block_pairs():
    """Query block i meets key blocks 0 .. the block of its last query's slot: 36 of the
    64 pairs of 64 causal keys in blocks of 8, and the forward's FLOPs follow (XLA's
    count of the loop unrolled, against dense attention's every pair)."""
    from rl_jax.kernels import loops

    i, j = xla.causal_pairs(64, 64, 0, 8)
    assert len(i) == 36 and np.all(j <= i) and len(set(zip(i, j, strict=True))) == 36
    # Completions at slot 16 of 32 keys; 11 queries over 12 keys (partial blocks).
    assert len(xla.causal_pairs(16, 32, 16, 8)[0]) == 3 + 4
    assert len(xla.causal_pairs(11, 12, 0, 4)[0]) == 1 + 2 + 3

    B, T, H, K, hd = 1, 32, 2, 1, 64
    q = jnp.ones((B, T, H, hd))
    kv = jnp.ones((B, K, T, hd))
    mask = xla.AttentionMask()

    def flops(fn):
        with loops.unrolled():
            return jax.jit(fn).lower(q, kv, kv).compile().cost_analysis()["flops"]

    def flash(q, k, v):
        return xla.flash_attention(q, k, v, mask, scale=0.1, block=8)

    dense = flops(lambda q, k, v: xla.attention(q, k, v, mask.block(T, 0, T), scale=0.1))
    assert flops(flash) < 0.75 * dense  # 10 of 16 block pairs: 0.625 of the products
    with loops.counting() as count:  # forward and backward: one loop key, 10 steps
        jax.jit(jax.grad(lambda *a: jnp.sum(flash(*a)))).lower(q, kv, kv)
    assert count.trips == {("flash_attention", 10, False): 10}


def _sgd_step(together, params, x_btd, tgt_bt, c_bt):
    """A train step's shape: layers, the LM head (a loss of the log-probs, the entropy a
    metric only), the backward, an update that reads every gradient."""

    def loss(params):
        h = x_btd
        for w in params["layers"]:
            h = jnp.tanh(h @ w)

        def head(h, t):
            return layers.logprobs_from_logits(jnp.einsum("btd,dv->btv", h, params["head"]), t)

        logp, ent = together(head, h, tgt_bt)
        return (logp * c_bt).sum(), (logp, ent)

    grads, (logp, ent) = jax.grad(loss, has_aux=True)(params)
    return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), logp, ent


def test_cpu_together_keeps_the_values_and_frees_the_logits_sooner():
    """cpu.together (a conditional) gives the plain call's log-probs, entropy and
    updated weights bit for bit, and the step holds fewer temporaries: the entropy is
    computed with the log-probs instead of after the backward, with the logits kept
    for it. (A reduction of the outputs may round differently: fused with their
    producer or not.)"""
    assert kernels.for_platform("cpu").together is cpu.together
    assert kernels.for_platform("tpu").together is xla.together
    keys = jax.random.split(jax.random.key(0), 8)
    params = {
        "layers": [jax.random.normal(k, (256, 256)) / 16 for k in keys[:4]],
        "head": jax.random.normal(keys[4], (256, 4096)) / 16,
    }
    x = jax.random.normal(keys[5], (8, 16, 256))
    tgt = jax.random.randint(keys[6], (8, 16), 0, 4096)
    c = jax.random.normal(keys[7], (8, 16))
    # Compiled with XLA:CPU's defaults, which runs use: under the test session's classic
    # emitters (conftest) both calls hold the same temporaries, so there is nothing to see.
    opts = {
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
        "xla_cpu_use_fusion_emitters": True,
        "xla_backend_optimization_level": 2,
    }
    out, temps = [], []
    for together in (xla.together, cpu.together):
        fn = jax.jit(functools.partial(_sgd_step, together, x_btd=x, tgt_bt=tgt, c_bt=c))
        out.append(fn(params))
        compiled = fn.lower(params).compile(compiler_options=opts)
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert temps[1] < temps[0], temps
