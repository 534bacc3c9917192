"""The TPU kernels (`rl_jax.kernels.tpu`): splash attention against the portable
`xla.flash_attention`, in Pallas's interpreter on this CPU, and compiled for a v5e."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import kernels
from rl_jax.kernels import loops, tpu, xla
from rl_jax.models import init_params, layers

# (T, S, offset, left pads per row, right pads per row, packed): T and S not multiples
# of the 128-slot blocks; "causal" spans 2 x 2 blocks (the kernel skips the one above
# the diagonal), "offset" is a completion's 70 queries at slots 130 .. 199 over a
# left-padded prompt and itself.
CASES = {
    "causal": (200, 200, 0, None, None, False),
    "offset": (70, 200, 130, (3, 0), (0, 0), False),
    "padded": (150, 150, 0, (3, 0), (0, 2), False),
    "packed": (150, 150, 0, None, None, True),
}


def _case(name):
    """q [2, T, 4, 16] over k / v [2, 2, S, 16] (grouped-query: 2 query heads per kv
    head), a cotangent, the mask described, and which rows see a key [2, T]."""
    T, S, offset, left, right, packed = CASES[name]
    ks = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(ks[0], (2, T, 4, 16))
    k, v = (jax.random.normal(x, (2, 2, S, 16)) for x in ks[1:3])
    d_out = jax.random.normal(ks[3], q.shape)
    valid = seg = None
    if left is not None:
        s = np.arange(S)[None]
        valid = jnp.asarray((s >= np.array(left)[:, None]) & (s < S - np.array(right)[:, None]))
    if packed:
        seg = jnp.asarray([[0] * 60 + [1] * 90, [0] * 149 + [1]])
    dense = layers.attention_mask(
        T, S, cache_index=offset or None, segment_ids_bt=seg, kv_valid_bs=valid
    )
    sees = jnp.broadcast_to(dense.any(-1), (2, T))
    return q, k, v, d_out, xla.AttentionMask(offset, valid, seg, seg), sees


def _value_and_grads(fn, q, k, v, d_out):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v) * d_out)

    return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))(q, k, v)


@pytest.mark.parametrize("name", sorted(CASES))
def test_splash_equals_xla_flash_attention_in_values_and_gradients(name):
    """Float32 throughout, so the two online softmaxes differ by rounding only: 1e-6 on
    values, 1e-5 on gradients (sums over up to 200 keys and 2 query heads per kv
    head). Rows that see no key (pads) are the kernels' one difference (the module's
    note): compared finite only, with a zero cotangent, as the model's masked loss
    gives them."""
    q, k, v, d_out, mask, sees = _case(name)
    d_out = jnp.where(sees[:, :, None, None], d_out, 0.0)
    want, want_g = _value_and_grads(
        lambda q, k, v: xla.flash_attention(q, k, v, mask, scale=0.25, block=128), q, k, v, d_out
    )
    got, got_g = _value_and_grads(
        lambda q, k, v: tpu.flash_attention(q, k, v, mask, scale=0.25, block=128, interpret=True),
        q,
        k,
        v,
        d_out,
    )
    assert bool(jnp.isfinite(got).all())
    rows = np.asarray(sees)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=1e-6, rtol=1e-6)
    for g, w, label in zip(got_g, want_g, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5, err_msg=label)


@pytest.mark.devices(4)
@pytest.mark.parametrize("kv_heads_split", [True, False])
def test_splash_runs_per_device_under_shard_map(kv_heads_split):
    """On a mesh, rows split over data and fsdp and heads over tensor, the kernel runs
    on each device's share (`shard_map`) and equals the unsharded one; where the kv
    heads are not split over tensor (too few), the query heads are not either."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
    heads = "tensor" if kv_heads_split else None
    layout = xla.AttentionLayout(
        mesh,
        PartitionSpec(("data", "fsdp"), None, "tensor", None),
        PartitionSpec(("data", "fsdp"), heads, None, None),
    )
    q, k, v, d_out, mask, sees = _case("offset")
    d_out = jnp.where(sees[:, :, None, None], d_out, 0.0)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    q, d_out = put(q, layout.q), put(d_out, layout.q)
    k, v = put(k, layout.kv), put(v, layout.kv)

    def run(layout):
        return _value_and_grads(
            lambda q, k, v: tpu.flash_attention(
                q, k, v, mask, scale=0.25, block=128, layout=layout, interpret=True
            ),
            q,
            k,
            v,
            d_out,
        )

    def traced(layout):
        fn = lambda q, k, v: tpu.flash_attention(  # noqa: E731
            q, k, v, mask, scale=0.25, block=128, layout=layout, interpret=True
        )
        return str(jax.make_jaxpr(fn)(q, k, v))

    assert "shard_map" in traced(layout) and "shard_map" not in traced(None)
    want, want_g = run(None)
    got, got_g = run(layout)
    rows = np.asarray(sees)
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(want)[rows], atol=1e-6, rtol=1e-6)
    for g, w, label in zip(got_g, want_g, "qkv", strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-6, err_msg=label)


def test_tpu_meshes_get_splash_and_counting_programs_the_reference(monkeypatch):
    """A TPU mesh's flash_attention is splash; every other platform keeps xla's. The
    plan's FLOP-counting traces take xla's (a Pallas call has no FLOPs XLA sees)."""
    assert kernels.for_platform("tpu").flash_attention is tpu.flash_attention
    assert kernels.for_platform("gpu").flash_attention is xla.flash_attention
    calls = []
    monkeypatch.setattr(xla, "flash_attention", lambda *a, **kw: calls.append(kw) or a[0])
    q, k, v, _, mask, _ = _case("causal")
    with loops.counting():
        tpu.flash_attention(q, k, v, mask, scale=0.25, block=128)
    with loops.unrolled():
        tpu.flash_attention(q, k, v, mask, scale=0.25, block=128)
    assert len(calls) == 2
    assert all(kw["bytes_per_flop"] > 0 for kw in calls)  # splash's, for the plan's bytes


def test_splash_bytes_per_flop_by_hand():
    """256 causal queries over 256 keys in blocks of 128: 3 block pairs of 4 x 128 x 128 x
    64 FLOPs, at each a key and a value block (2 x 128 x 64 x 2 bytes), and per query block
    the queries and the output (as many) and the log-sum-exp (128 x 128 x 4); segment ids
    add 8 x 128 x 4 a pair and 128 x 128 x 4 a query block."""
    flops = 3 * 4 * 128 * 128 * 64
    plain = 3 * 32_768 + 2 * (32_768 + 65_536)
    assert tpu._bytes_per_flop(256, 256, 0, 128, 128, 64, 2, False) == plain / flops
    segments = plain + 3 * 4_096 + 2 * 65_536
    assert tpu._bytes_per_flop(256, 256, 0, 128, 128, 64, 2, True) == segments / flops
    # Above the ridge of every TPU the plan knows (v5p: 459e12 / 2.765e12 = 166 FLOPs a
    # byte) at the model's 512-slot blocks and ScaleRL's lengths: compute-bound.
    assert 1 / tpu._bytes_per_flop(15_360, 15_360, 0, 512, 512, 128, 2, True) > 166


def test_the_counting_trace_records_splash_bytes_for_its_loops():
    """A counting trace of splash's gradient (forward and backward, one loop key) records
    the kernel's bytes per FLOP for the key; xla's attention, which runs as that loop,
    records none."""
    q, k, v, _, mask, _ = _case("padded")

    def grad(fn):
        with loops.counting() as count:
            jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, mask, scale=0.25, block=128)))).lower(
                q, k, v
            )
        return count

    splash, plain = grad(tpu.flash_attention), grad(xla.flash_attention)
    assert plain.fused == {} and splash.trips == plain.trips
    (key,) = splash.trips
    T, S, hd = q.shape[1], k.shape[2], q.shape[3]
    itemsize = jnp.dtype(q.dtype).itemsize
    segments = mask.kv_valid_bs is not None or mask.q_segment_bt is not None
    bq, bkv = tpu._block(128, T), tpu._block(128, S)
    want = tpu._bytes_per_flop(T, S, int(mask.offset), bq, bkv, hd, itemsize, segments)
    assert splash.fused == {key: want}


def test_blockwise_train_step_compiles_splash_for_v5e(no_compilation_cache):
    """A tiny model's train step with model.attention=blockwise, compiled for v5e:2x2
    through libtpu from this host: its program holds splash's Mosaic kernels (forward,
    dq and dkv: `tpu_custom_call`); the same step lowered for CPU devices holds none."""
    from rl_jax.config import load_recipe
    from rl_jax.knobs import ConfigError
    from rl_jax.plan import _programs as pp
    from rl_jax.sharding.mesh import make_mesh

    knobs = [
        "model.preset=tiny",
        "model.num_layers=1",
        "model.hidden_size=64",
        "model.intermediate_size=128",
        "model.attention=blockwise",
        "data.prompts_per_batch=2",
        "sampling.n=2",
        "sampling.max_prompt_len=16",
        "sampling.max_new_tokens=16",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=1",
    ]
    try:
        t = pp.plan_target(load_recipe("scalerl", knobs), "v5e:2x2")
    except ConfigError as e:
        pytest.skip(f"libtpu cannot describe a TPU topology here: {e}")
    cfg, mesh, tg = t.cfg, t.mesh, t.tg

    def update_program(mesh):
        on = dataclasses.replace(t, mesh=mesh, sample_mesh=mesh)
        run = on.programs().step_programs(t.tp, tg, minibatches=1)
        fn, args, _ = run["train_step"]
        return fn.trace(*args).lower()

    compiled = update_program(mesh).compile()
    # 2 forwards (prompt, completions) and each one's dq and dkv kernels, more than once
    # where remat recomputes a forward.
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 6
    # The completion stream (its tokens, positions, validity) runs at a multiple of the
    # sequence tile (16), not tg - 1 columns: an odd length makes libtpu copy
    # [B, T, D] -> [B * T, D] row by row, in code that grows with B * T (minutes of
    # compile at 8B's lengths). Its output is sliced to tg - 1 columns after the layers.
    odd = re.findall(rf"(?:s32|pred)\[[\d,]*\b{tg - 1}\b[\d,]*\]", text)
    assert tg % 16 == 0 and not odd, odd[:5]
    cpu_mesh = make_mesh(cfg.mesh, devices=jax.devices()[:4])
    assert "tpu_custom_call" not in update_program(cpu_mesh).as_text()


def _paged_case(dtype=jnp.bfloat16):
    """4 rows over a paged cache of 2 layers, 12 pages of 16 positions, 2 kv heads of
    width 16 and 2 query heads each: tables of 4 pages (9: no page), rows at positions
    0, 20, 37 and 63 (the last ended: it writes nothing), the projection's rows and
    RoPE's angles of this step."""
    ks = jax.random.split(jax.random.key(4), 3)
    keys, values = (jax.random.normal(k, (2, 2, 12, 16, 16)).astype(dtype) for k in ks[:2])
    qkv = jax.random.normal(ks[2], (4, (4 + 2 * 2) * 16))
    table = jnp.asarray([[3, 12, 12, 12], [0, 5, 12, 12], [7, 1, 2, 12], [4, 6, 8, 10]], jnp.int32)
    pos = jnp.asarray([0, 20, 37, 63], jnp.int32)
    live = jnp.asarray([True, True, True, False])
    angles = pos[:, None, None] * 0.01 * jnp.arange(8)[None, None, :]
    return xla.PagedKV(keys, values), qkv, (jnp.cos(angles), jnp.sin(angles)), table, pos, live


def test_paged_attention_kernel_equals_the_reference():
    """The Pallas paged attention kernel (`tpu.Decode`, in Pallas's interpreter) against
    XLA's paged reference (`xla.Decode`) on a bfloat16 cache, layer 1: the same cache
    written (the step's keys and values of the live rows, nothing of the ended one),
    and the same attention for the live rows to float32 rounding (both multiply the
    bfloat16 keys in float32; the kernel's softmax runs online over blocks)."""
    cache, qkv, rope, table, pos, live = _paged_case()
    pages = xla.Pages(table, live)

    def run(ops):
        fn = jax.jit(lambda c, x: ops.paged_attention(x, rope, c, pages, pos, layer=1, num_heads=4))
        return fn(cache, qkv)

    want, want_cache = run(xla.Decode("cpu"))
    got, got_cache = run(tpu.Decode("cpu", interpret=True))
    for g, w in zip(got_cache, want_cache, strict=True):
        np.testing.assert_array_equal(g, w)
    changed = np.asarray(want_cache.keys != cache.keys).any(axis=(0, 1, 3, 4))  # [N] pages
    assert changed.tolist() == [i in (3, 5, 2) for i in range(12)]  # rows 0-2's own pages
    np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], atol=2e-6, rtol=2e-6)


def test_engine_generate_compiles_the_paged_kernel_for_v5e(no_compilation_cache):
    """The engine's generate for a bfloat16 model on v5e:2x2 (rows and their pages over
    the 4 chips), compiled through libtpu from this host: the paged attention kernel
    runs in it (`tpu_custom_call`), the cache keeps the kernel's layout throughout (no
    copy of a whole cache: libtpu laid it out token-major for a scatter of [K, B, hd]
    windows and copied it at every layer, `xla.Decode.write_page`), and the CPU lowering
    of the same program holds no kernel."""
    from rl_jax.config import MeshConfig, ModelConfig, SamplingConfig
    from rl_jax.knobs import ConfigError
    from rl_jax.models import resolve_spec
    from rl_jax.plan._programs import topology_devices
    from rl_jax.sampling import Engine
    from rl_jax.sharding import make_mesh

    try:
        devices = topology_devices("v5e:2x2")
    except ConfigError as e:
        pytest.skip(f"libtpu cannot describe a TPU topology here: {e}")
    spec = resolve_spec(
        ModelConfig(
            preset="tiny",
            num_layers=2,
            hidden_size=256,
            num_heads=8,
            num_kv_heads=4,
            head_dim=128,
            param_dtype="bfloat16",
            compute_dtype="bfloat16",
        )
    )
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=112, max_prompt_len=16, length_bucket=16)

    def generate(devices):
        mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=1), devices=devices)
        engine = Engine(spec, cfg, slots=8, chunk=4, mesh=mesh, pad_id=0)
        shapes = jax.eval_shape(lambda: init_params(spec, jax.random.key(0)))
        shard = engine.param_shardings()
        params = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shard[k]) for k, v in shapes.items()
        }
        fn, args, kw = engine.programs(params)["generate"]
        return engine, fn.trace(*args, **kw).lower()

    engine, lowered = generate(devices[:4])
    assert engine.page_size == 64 and engine.row_pages == 2
    text = lowered.compile().as_text()
    assert "tpu_custom_call" in text
    K, L, N = 4, 2, engine.kv_pages // 4  # the cache per chip [K, L, N, P, hd]
    whole = re.findall(rf"= bf16\[{K},{L},{N},64,128\]{{[^}}]*}} copy\(", text)
    assert not whole, whole
    assert "tpu_custom_call" not in generate(jax.devices()[:4])[1].as_text()


# ---- megablox: the grouped matmul of a mixture of experts ----------------------------------


@pytest.mark.parametrize(
    "M,D,N,sizes",
    [(40, 24, 20, (10, 0, 18, 9)), (300, 64, 200, (100, 150, 50)), (5, 8, 8, (2, 3))],
    ids=["rows_past_the_groups", "three_row_tiles", "fewer_rows_than_a_tile"],
)
def test_megablox_grouped_matmul_equals_xla_in_values_and_gradients(M, D, N, sizes):
    """megablox's gmm / tgmm in Pallas's interpreter against `xla.grouped_matmul`
    (ragged_dot), float32: values and both gradients to rounding; rows past the groups
    zero, an empty group, M not a multiple of the row tile."""
    rng = np.random.default_rng(M)
    G = len(sizes)
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(G, D, N)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
    g = jnp.asarray(sizes, jnp.int32)

    def run(fn):
        loss = lambda x, w: jnp.sum(fn(x, w, g) * ct)  # noqa: E731
        return jax.jit(lambda x, w: (fn(x, w, g), jax.grad(loss, (0, 1))(x, w)))(x, w)

    got, (gx, gw) = run(functools.partial(tpu.grouped_matmul, interpret=True))
    want, (wx, ww) = run(xla.grouped_matmul)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[sum(sizes) :], 0.0)
    np.testing.assert_allclose(gx, wx, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(gw, ww, atol=1e-4, rtol=1e-5)
    assert kernels.for_platform("tpu").grouped_matmul is tpu.grouped_matmul
    with loops.counting():  # a plan's counting programs take XLA's, whose FLOPs it sees
        jax.jit(lambda x, w: tpu.grouped_matmul(x, w, g)).lower(x, w)


def test_a_plan_counts_the_weight_gradient_at_the_bytes_tgmm_moves():
    """In a plan's counting program the weights' gradient is XLA's stand-in, a loop over
    chunks of row blocks whose gathers tgmm does not make: the loop is counted as a fused
    kernel at tgmm's bytes per FLOP. By hand, x [256, 256] and dy [256, 128] in bf16 over
    4 groups: row tiles of 128, at most 4 more for the groups' boundaries (768 rows);
    a row's x read once (N in one tile of 128), its dy twice (D in two): 2 x (256 + 2 x
    128) bytes a row; the [4, 256, 128] gradient written once; over 2 x 256 x 256 x 128
    FLOPs: (768 x 1024 + 262,144) / 16,777,216 = 1 / 16. Called in a layer's body, the
    loop counts once per layer, though autodiff traces the backward after the body."""
    x = jnp.zeros((256, 256), jnp.bfloat16)
    w = jnp.zeros((4, 256, 128), jnp.bfloat16)
    g = jnp.asarray([100, 0, 120, 36], jnp.int32)
    layer = loops.layer_body(lambda x, w: tpu.grouped_matmul(x, w, g))
    loss = lambda x, w: jnp.sum(layer(x, w).astype(jnp.float32))  # noqa: E731
    with loops.counting() as count:
        jax.jit(jax.grad(loss, (0, 1))).lower(x, w)
    # Blocks of 16 rows (256 / (4 x 4 groups)): 16 and one partial a group, 2 chunks of 16.
    assert count.trips == {("grouped_weight_grad", 2, True): 2}
    assert count.fused == {("grouped_weight_grad", 2, True): 1 / 16}


@pytest.mark.devices(8)
def test_megablox_in_the_moe_shard_map_equals_one_device():
    """The sparse MLP on data 2 x fsdp 2 x tensor 2 with megablox (interpreted) as its
    grouped matmul: the output, the router statistics and the gradients of the router,
    the experts and the rows equal one device's with XLA's."""
    from rl_jax.config import MeshConfig
    from rl_jax.models.moe import moe_mlp, sharded_moe_mlp
    from rl_jax.sharding import get_rules, make_mesh

    mesh, rules = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)), get_rules("fsdp_tp")
    rng = np.random.default_rng(0)
    N, T, D, E, Fe = 8, 6, 32, 4, 16
    h = jnp.asarray(rng.normal(size=(N, T, D)), jnp.float32)
    shapes = [(D, E), (E, D, Fe), (E, D, Fe), (E, Fe, D)]
    ws = tuple(jnp.asarray(rng.normal(size=s) * 0.3, jnp.float32) for s in shapes)
    gmm = functools.partial(tpu.grouped_matmul, interpret=True)

    def loss(ws, h, sharded):
        kw = dict(top_k=2, norm_topk_prob=True)
        if sharded:
            out, st, _ = sharded_moe_mlp(mesh, rules, h, ws, None, grouped_matmul=gmm, **kw)
        else:
            out, st, _ = moe_mlp(h, *ws, grouped_matmul=xla.grouped_matmul, **kw)
        return jnp.sum(jnp.sin(out)) + 0.1 * st.z, st

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (l8, s8), g8 = jax.jit(lambda ws, h: grad(ws, h, True))(ws, h)
    (l1, s1), g1 = jax.jit(lambda ws, h: grad(ws, h, False))(ws, h)
    np.testing.assert_allclose(l8, l1, rtol=1e-5)
    for a, b in zip(s8, s1, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
