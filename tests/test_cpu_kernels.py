"""The CPU decode kernels (rl_jax/kernels/_cpu_attention.cc, _cpu_matmul.cc) against
float64 attention over the same paged cache and float64 matmuls, and their build's
failure modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax.kernels import cpu as _cpu_kernels
from rl_jax.kernels.cpu import KEY_TILE

needs_kernel = pytest.mark.skipif(
    jax.devices()[0].platform != "cpu" or not _cpu_kernels.available(),
    reason="the CPU decode-attention kernel cannot be built here (no C++ compiler)",
)


def _tiles(keys):
    """Paged keys [K, L, N, P, hd] -> the kernel's tiles [K, L, N, P / 16, hd, 16]."""
    K, L, N, P, hd = keys.shape
    return keys.reshape(K, L, N, P // KEY_TILE, KEY_TILE, hd).swapaxes(-1, -2)


def _paged_case(rng, B, K, hd, P, W, layers=2):
    """A paged cache of `layers` layers, B rows of W pages each (pages handed out in a
    random order, two pages no row owns), float32 keys and values [K, L, N, P, hd]; each
    row's position (row 0 at its table's last, the last row at 0) and its table (N, no
    page, past the page of its position)."""
    N = B * W + 2
    keys, values = (rng.standard_normal((K, layers, N, P, hd)).astype(np.float32) for _ in "kv")
    table = rng.permutation(N)[: B * W].reshape(B, W).astype(np.int32)
    pos = rng.integers(0, W * P, (B,)).astype(np.int32)
    pos[0], pos[-1] = W * P - 1, 0 if B > 1 else pos[-1]
    table[np.arange(W)[None, :] > (pos // P)[:, None]] = N
    return keys, values, table, pos


def _paged_reference(q, k_new, v_new, keys, values, table, pos, live, layer, scale):
    """In float64: each live row's k and v written at its position of `layer`, then
    softmax(scale * q k^T) v over its positions 0 .. pos (zeros for the other rows)."""
    B, K, R, hd = q.shape
    P = values.shape[3]
    keys, values = keys.copy(), values.copy()
    out = np.zeros((B, K, R, hd))
    for b in np.flatnonzero(live):
        page, off = table[b, pos[b] // P], pos[b] % P
        keys[:, layer, page, off], values[:, layer, page, off] = k_new[b], v_new[b]
    for b in np.flatnonzero(live):
        at = np.arange(pos[b] + 1)
        kb = keys[:, layer, table[b, at // P], at % P].astype(np.float64)  # [K, n, hd]
        vb = values[:, layer, table[b, at // P], at % P].astype(np.float64)
        s = np.einsum("krh,knh->krn", q[b].astype(np.float64), kb) * scale
        w = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("krn,knh->krh", w / w.sum(-1, keepdims=True), vb)
    return out, keys, values


@needs_kernel
@pytest.mark.parametrize(
    "B,K,R,hd,P,W",
    [
        (6, 2, 2, 64, 16, 5),  # the bench model's heads
        (4, 3, 3, 32, 16, 2),  # three query heads per KV head
        (3, 1, 7, 128, 32, 10),  # seven, 128-wide heads, a long row
        (2, 2, 1, 64, 16, 1),  # one page; a row at position 0
        (3, 2, 5, 48, 48, 1),  # head width not a multiple of 32; pages of three tiles
        (2, 1, 9, 80, 32, 2),  # more query heads than one pass takes (4)
        (5, 2, 2, 16, 16, 3),  # page boundaries
    ],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_paged_kernel_equals_float64_attention(B, K, R, hd, P, W, parallel):
    """Rows at different positions over pages in any order, every query-head grouping,
    layer 1 of a stack of 2: the new key and value land at each live row's position
    (nothing else changes: not the other layer, not a row that ended, not a page no
    row owns), and the attention is within float32 rounding of float64's softmax
    attention; a row that ended gets zeros. Positions past a row's own hold garbage
    (NaN), which must not be read."""
    rng = np.random.default_rng(B * 1000 + W * P)
    keys, values, table, pos = _paged_case(rng, B, K, hd, P, W)
    q = rng.standard_normal((B, K, R, hd)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((B, K, hd)).astype(np.float32) for _ in "kv")
    live = np.arange(B) != 1 if B > 2 else np.ones(B, bool)
    for b in range(B):
        at = np.arange(pos[b], W * P)
        pages = table[b, at // P]
        ok = pages < keys.shape[2]
        keys[:, 1, pages[ok], at[ok] % P] = np.nan
        values[:, 1, pages[ok], at[ok] % P] = np.nan
    scale = hd**-0.5
    want, want_keys, want_values = _paged_reference(
        q, k_new, v_new, keys, values, table, pos, live, 1, scale
    )
    call = jax.jit(
        lambda q, k, v, keys, values: _cpu_kernels.paged_attention(
            (q, k, v), keys, values, table, pos, live, 1, scale, parallel=parallel
        )
    )
    got, got_keys, got_values = call(q, k_new, v_new, _tiles(jnp.array(keys)), jnp.array(values))
    assert got.shape == (B, K, R, hd) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(got_keys), np.asarray(_tiles(jnp.array(want_keys))))
    np.testing.assert_array_equal(np.asarray(got_values), want_values)


@needs_kernel
@pytest.mark.parametrize("B,K,R,hd,P,W", [(6, 2, 2, 64, 16, 5), (3, 1, 7, 32, 48, 1)])
def test_fused_qkv_kernel_equals_split_rotate_attend(B, K, R, hd, P, W):
    """paged_attention on the projection's rows [B, (H + 2K) hd] with RoPE's angles
    equals XLA's split and rotation (apply_rope) followed by paged_attention on q, k,
    v: the same cache writes, attention within float32 rounding, as [B, H hd]."""
    from rl_jax.models.layers import apply_rope

    rng = np.random.default_rng(P + W)
    H = K * R
    keys, values, table, pos = _paged_case(rng, B, K, hd, P, W)
    live = np.ones(B, bool)
    qkv = jnp.asarray(rng.standard_normal((B, (H + 2 * K) * hd)), jnp.float32)
    ang = rng.uniform(0, 6.3, (B, hd // 2))
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    cache = (lambda: _tiles(jnp.array(keys)), lambda: jnp.array(values))

    def split(qkv, keys, values):
        q = apply_rope(qkv[:, : H * hd].reshape(B, 1, H, hd), cos[:, None], sin[:, None])
        k = apply_rope(
            qkv[:, H * hd : (H + K) * hd].reshape(B, 1, K, hd), cos[:, None], sin[:, None]
        )
        v = qkv[:, (H + K) * hd :].reshape(B, K, hd)
        inputs = (q.reshape(B, K, R, hd), k.reshape(B, K, hd), v)
        att, keys, values = _cpu_kernels.paged_attention(
            inputs, keys, values, table, pos, live, 0, hd**-0.5
        )
        return att.reshape(B, H * hd), keys, values

    def fused(qkv, keys, values):
        inputs = (qkv, cos, sin)
        return _cpu_kernels.paged_attention(inputs, keys, values, table, pos, live, 0, hd**-0.5)

    want = jax.jit(split)(qkv, *(c() for c in cache))
    got = jax.jit(fused)(qkv, *(c() for c in cache))
    assert got[0].shape == (B, H * hd)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-5, atol=2e-6)
    for g, w in zip(got[1:], want[1:], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@needs_kernel
def test_stacked_matmul_reads_its_layer_in_place():
    """With weights stacked over layers and a layer index (the decode step's scan over
    layers), the matmul kernel uses that layer's panels alone; a layer past the stack
    is an error."""
    rng = np.random.default_rng(5)
    L = 3
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
    keys = jnp.zeros((2, 1, 3, 5, 64, 16), jnp.float32)
    values = jnp.zeros((2, 1, 3, 72, 64), jnp.float32)  # pages of 72 positions, keys hold 80
    table, pos = jnp.zeros((2, 1), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(Exception, match=r"keys \[K,L,N,P/16,hd,16\]"):
        _cpu_kernels.paged_attention((q, kv, kv), keys, values, table, pos, pos + 1, 0, 0.125)
    with pytest.raises(Exception, match="layer 1 is outside the cache's 1"):
        values = jnp.zeros((2, 1, 3, 80, 64), jnp.float32)
        _cpu_kernels.paged_attention((q, kv, kv), keys, values, table, pos, pos + 1, 1, 0.125)


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
