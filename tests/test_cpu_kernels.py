"""The CPU decode kernels (rl_jax/kernels/_cpu_attention.cc, _cpu_matmul.cc) against
XLA's attention on the same cache and float64 matmuls, and their build's failure
modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.kernels import cpu as _cpu_kernels
from rl_jax.kernels.cpu import KEY_TILE
from rl_jax.kernels.xla import MASK_VALUE, einsum_f32

needs_kernel = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu" or not _cpu_kernels.available(),
    reason="the CPU decode-attention kernel cannot be built here (no C++ compiler)",
)


def _reference(q, keys_t, values, kv_start, slot):
    """The sampler's XLA attention: keys [B, K, hd, S]."""
    hd, S = keys_t.shape[2], keys_t.shape[3]
    s = einsum_f32("bkrh,bkhs->bkrs", q, keys_t)
    k_slot = jnp.arange(S)
    visible = (k_slot[None, :] >= kv_start[:, None]) & (k_slot[None, :] <= slot)
    s = jnp.where(visible[:, None, None, :], s * hd**-0.5, MASK_VALUE)
    return einsum_f32("bkrs,bksh->bkrh", jax.nn.softmax(s, axis=-1), values)


def _tiles(keys_t):
    """[B, K, hd, S] -> [B, K, S / 16, hd, 16]."""
    B, K, hd, S = keys_t.shape
    return keys_t.reshape(B, K, hd, S // KEY_TILE, KEY_TILE).transpose(0, 1, 3, 2, 4)


@needs_kernel
@pytest.mark.parametrize(
    "B,K,R,hd,S,slot",
    [
        (6, 2, 2, 64, 80, 40),  # the bench model's heads
        (4, 3, 3, 32, 32, 19),  # three query heads per KV head
        (3, 1, 7, 128, 304, 150),  # seven, 128-wide heads, a long cache
        (2, 2, 1, 64, 16, 0),  # one slot
        (3, 2, 5, 48, 48, 47),  # head width not a multiple of 32; the last slot
        (2, 1, 9, 80, 64, 33),  # more query heads than one pass takes (4)
        (5, 2, 2, 16, 48, 31),  # a tile boundary
    ],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_kernel_equals_xla_attention(B, K, R, hd, S, slot, parallel):
    """Rows with different first visible slots (left padding), every query-head
    grouping: the new key and value land at `slot` (nothing else changes), and the
    attention is within float32 rounding of XLA's masked softmax attention. Slots
    past `slot` hold garbage (NaN), which must not be read."""
    rng = np.random.default_rng(B * 1000 + S)
    q = jnp.asarray(rng.standard_normal((B, K, R, hd)), jnp.float32)
    keys_t = rng.standard_normal((B, K, hd, S)).astype(np.float32)
    values = rng.standard_normal((B, K, S, hd)).astype(np.float32)
    kv_start = jnp.asarray(rng.integers(0, slot + 1, (B,)), jnp.int32)
    # jnp.array copies: jnp.asarray may share the numpy buffer, written below while
    # the (asynchronous) reference could still be reading it.
    want = np.asarray(_reference(q, jnp.array(keys_t), jnp.array(values), kv_start, slot))
    k_new, v_new = keys_t[..., slot].copy(), values[:, :, slot].copy()
    keys_t[..., slot:] = np.nan
    values[:, :, slot:] = np.nan
    call = jax.jit(
        lambda q, k, v, keys, values, s0: _cpu_kernels.decode_attention(
            q, k, v, keys, values, s0, slot, hd**-0.5, parallel=parallel
        )
    )
    got, keys, values_out = call(
        q, k_new, v_new, _tiles(jnp.array(keys_t)), jnp.array(values), kv_start
    )
    assert got.shape == (B, K, R, hd) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    keys_t[..., slot] = k_new
    values[:, :, slot] = v_new
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(_tiles(jnp.array(keys_t))))
    np.testing.assert_array_equal(np.asarray(values_out), values)


@needs_kernel
@pytest.mark.parametrize("B,K,R,hd,S,slot", [(6, 2, 2, 64, 80, 40), (3, 1, 7, 32, 48, 47)])
def test_fused_qkv_kernel_equals_split_rotate_attend(B, K, R, hd, S, slot):
    """decode_attention_qkv on the projection's rows [B, (H + 2K) hd] equals XLA's
    split and rotation (apply_rope) followed by decode_attention: the same cache
    writes, attention within float32 rounding, as [B, H hd]."""
    from rl_jax.models.layers import apply_rope

    rng = np.random.default_rng(S + slot)
    H = K * R
    qkv = jnp.asarray(rng.standard_normal((B, (H + 2 * K) * hd)), jnp.float32)
    ang = rng.uniform(0, 6.3, (B, hd // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    keys = jnp.asarray(rng.standard_normal((B, K, S // KEY_TILE, hd, KEY_TILE)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((B, K, S, hd)), jnp.float32)
    kv_start = jnp.asarray(rng.integers(0, slot + 1, (B,)), jnp.int32)

    def split(qkv, keys, values):
        q = apply_rope(qkv[:, : H * hd].reshape(B, 1, H, hd), cos[:, None], sin[:, None])
        k = apply_rope(
            qkv[:, H * hd : (H + K) * hd].reshape(B, 1, K, hd), cos[:, None], sin[:, None]
        )
        v = qkv[:, (H + K) * hd :].reshape(B, K, hd)
        att, keys, values = _cpu_kernels.decode_attention(
            q.reshape(B, K, R, hd), k.reshape(B, K, hd), v, keys, values, kv_start, slot, hd**-0.5
        )
        return att.reshape(B, H * hd), keys, values

    def fused(qkv, keys, values):
        return _cpu_kernels.decode_attention_qkv(
            qkv, cos, sin, keys, values, kv_start, slot, hd**-0.5
        )

    want = jax.jit(split)(qkv, jnp.array(keys), jnp.array(values))
    got = jax.jit(fused)(qkv, jnp.array(keys), jnp.array(values))
    assert got[0].shape == (B, H * hd)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-5, atol=2e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@needs_kernel
def test_stacked_layers_are_read_and_written_in_place():
    """With a cache and weights stacked over layers and a layer index (the decode
    step's scan over layers), the kernels use that layer's part alone: the same
    results as on the layer's own arrays, the other layers' cache untouched."""
    rng = np.random.default_rng(5)
    L, B, K, R, hd, S, slot, layer = 3, 2, 2, 2, 32, 32, 9, 1
    q = jnp.asarray(rng.standard_normal((B, K, R, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, K, hd)), jnp.float32) for _ in range(2))
    keys = jnp.asarray(rng.standard_normal((L, B, K, S // KEY_TILE, hd, KEY_TILE)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((L, B, K, S, hd)), jnp.float32)
    kv_start = jnp.zeros((B,), jnp.int32)
    one = jax.jit(
        lambda kk, vv: _cpu_kernels.decode_attention(q, k, v, kk, vv, kv_start, slot, 0.2)
    )
    stacked = jax.jit(
        lambda kk, vv, i: _cpu_kernels.decode_attention(
            q, k, v, kk, vv, kv_start, slot, 0.2, layer=i
        )
    )
    want = one(jnp.array(keys[layer]), jnp.array(values[layer]))
    got = stacked(jnp.array(keys), jnp.array(values), jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for g, w, before in zip(got[1:], want[1:], (keys, values), strict=True):
        np.testing.assert_array_equal(np.asarray(g[layer]), np.asarray(w))
        others = [i for i in range(L) if i != layer]
        np.testing.assert_array_equal(np.asarray(g)[others], np.asarray(before)[others])

    w = rng.standard_normal((L, 40, 24)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((5, 40)), jnp.float32)
    panels = jax.vmap(_cpu_kernels.pack_panels)(jnp.asarray(w))
    got = jax.jit(lambda x, p, i: _cpu_kernels.matmul(x, p, 24, layer=i))(x, panels, 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ w[2], rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="layer"):
        jax.jit(lambda x, p: _cpu_kernels.matmul(x, p, 24, layer=3))(x, panels).block_until_ready()


@needs_kernel
def test_kernel_rejects_wrong_shapes():
    q = jnp.zeros((2, 2, 2, 64), jnp.float32)
    kv = jnp.zeros((2, 2, 64), jnp.float32)
    keys = jnp.zeros((2, 2, 5, 64, 16), jnp.float32)
    values = jnp.zeros((2, 2, 72, 64), jnp.float32)  # 72 slots, keys hold 80
    with pytest.raises(Exception, match=r"keys \[L,B,K,S/16,hd,16\]"):
        _cpu_kernels.decode_attention(q, kv, kv, keys, values, jnp.zeros((2,), jnp.int32), 3, 0.125)


@needs_kernel
@pytest.mark.parametrize(
    "M,K,N",
    [
        (64, 256, 1376),  # the bench model's gate/up projection
        (64, 688, 256),  # its down projection
        (1, 1, 1),
        (7, 5, 47),  # a short row tile, a partial panel
        (8, 300, 48),  # one whole panel (AVX-512); K past one block of 256
        (9, 520, 49),  # a row past the tile, a column past the panel, three K blocks
        (300, 64, 96),  # more rows than one work item takes (256)
        (5, 0, 7),  # K = 0: zeros
        (0, 16, 33),  # no rows
    ],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_matmul_equals_float64(M, K, N, parallel):
    """x @ w through pack_panels and the kernel, within float32 rounding of float64,
    for every edge of the register tile, the panels and the K blocks."""
    rng = np.random.default_rng(M * 7 + K * 3 + N)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)
    panels = _cpu_kernels.pack_panels(jnp.asarray(w))
    nr = _cpu_kernels.panel_width()
    assert panels.shape == (-(-N // nr), K, nr)
    call = jax.jit(lambda x, p: _cpu_kernels.matmul(x, p, N, parallel=parallel))
    got = np.asarray(call(x, panels))
    assert got.shape == (M, N) and got.dtype == np.float32
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(max(K, 1)))


@needs_kernel
@pytest.mark.parametrize(
    "M,K,F",
    [
        (64, 256, 688),  # the bench model's MLP
        (1, 16, 1),
        (7, 5, 47),  # a short row tile, a part panel
        (13, 700, 33),  # three K blocks (sums carried in the scratch), a part panel
        (300, 64, 24),  # more rows than one work item takes
        (3, 0, 5),  # K = 0: silu(0) * 0
    ],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_matmul_swiglu_equals_float64(M, K, F, parallel):
    """silu(x @ gate) * (x @ up) from SwiGLU panels, within float32 rounding of float64;
    pre-activations of both signs and large magnitudes (the sigmoid of -|g|)."""
    rng = np.random.default_rng(M + K + F)
    x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
    gate = rng.standard_normal((K, F)).astype(np.float32)
    up = rng.standard_normal((K, F)).astype(np.float32)
    panels = _cpu_kernels.pack_swiglu_panels(jnp.asarray(gate), jnp.asarray(up))
    call = jax.jit(lambda x, p: _cpu_kernels.matmul_swiglu(x, p, F, parallel=parallel))
    got = np.asarray(call(x, panels))
    assert got.shape == (M, F) and got.dtype == np.float32
    g, u = x.astype(np.float64) @ gate, x.astype(np.float64) @ up
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


@needs_kernel
@pytest.mark.parametrize("M,K,N", [(64, 256, 512), (7, 5, 47), (13, 700, 33), (2, 0, 3)])
def test_folded_norm_residual_and_rows_equal_float64(M, K, N):
    """The decode step's fused forms against float64: RMSNorm(x) @ w with the norm's
    weight folded into the panels (matmul and matmul_swiglu, norm_eps), residual +
    x @ w summed in place (matmul_add), and table rows by id, clipped (take_rows)."""
    rng = np.random.default_rng(M + K + N)
    eps = 1e-6
    x = (rng.standard_normal((M, K)) * 3).astype(np.float32)
    norm = rng.standard_normal(K).astype(np.float32)
    w, up = rng.standard_normal((2, K, N)).astype(np.float32)
    r = rng.standard_normal((M, N)).astype(np.float32)
    x64 = x.astype(np.float64)
    h = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * norm if K else x64
    tol = dict(rtol=2e-5, atol=2e-5 * max(1.0, np.sqrt(K)))

    fold = jnp.asarray(norm)[:, None]
    got = jax.jit(lambda x, p: _cpu_kernels.matmul(x, p, N, norm_eps=eps))(
        x, _cpu_kernels.pack_panels(fold * jnp.asarray(w))
    )
    np.testing.assert_allclose(np.asarray(got), h @ w, **tol)
    panels = _cpu_kernels.pack_swiglu_panels(fold * jnp.asarray(w), fold * jnp.asarray(up))
    got = jax.jit(lambda x, p: _cpu_kernels.matmul_swiglu(x, p, N, norm_eps=eps))(x, panels)
    g, u = h @ w, h @ up
    np.testing.assert_allclose(np.asarray(got), g / (1 + np.exp(-g)) * u, **tol)

    got = jax.jit(lambda x, p, r: _cpu_kernels.matmul_add(x, p, r))(
        x, _cpu_kernels.pack_panels(jnp.asarray(w)), jnp.asarray(r)
    )
    np.testing.assert_allclose(np.asarray(got), r + x64 @ w, **tol)

    ids = jnp.asarray([0, M - 1, -3, M + 5, M // 2][: max(M, 1)], jnp.int32)
    table = jnp.asarray(r) if M else jnp.ones((1, N), jnp.float32)
    got = jax.jit(_cpu_kernels.take_rows)(table, ids)
    want = np.asarray(table)[np.clip(np.asarray(ids), 0, table.shape[0] - 1)]
    np.testing.assert_array_equal(np.asarray(got), want)


@needs_kernel
def test_matmul_rejects_unpacked_weights():
    x = jnp.zeros((4, 32), jnp.float32)
    with pytest.raises(Exception, match=r"panels \[L, ceil\(N / \d+\), K, \d+\]"):
        bad = jnp.zeros((1, 32, _cpu_kernels.panel_width() + 1), jnp.float32)
        jax.jit(lambda x, w: _cpu_kernels.matmul(x, w, 8))(x, bad)


def test_unavailable_without_a_working_compiler(monkeypatch, tmp_path, caplog):
    """A compiler that fails (or RL_JAX_CPU_KERNELS=0) leaves the kernel off with a
    warning that says so; nothing half-written is left in the cache directory."""
    build = _cpu_kernels.available.__wrapped__  # past the per-process cache
    monkeypatch.setenv("RL_JAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("RL_JAX_CPU_KERNELS", "0")
    assert build() is False
    monkeypatch.setenv("RL_JAX_CPU_KERNELS", "1")
    monkeypatch.setenv("CXX", "false")
    with caplog.at_level("WARNING"):
        assert build() is False
    assert "unavailable" in caplog.text and "failed" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_damaged_cache_entry_is_rebuilt(monkeypatch, tmp_path):
    """A truncated library in the kernel cache is built again, not trusted or kept."""
    if not _cpu_kernels._compiler():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("RL_JAX_KERNEL_CACHE", str(tmp_path))
    path = _cpu_kernels._library_path(_cpu_kernels._compiler())
    path.write_bytes(b"not a shared library")
    assert _cpu_kernels._load_library(_cpu_kernels._compiler()) is not None
    assert path.stat().st_size > 1000
