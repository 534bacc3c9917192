"""The `cpu` kernels: XLA's ops with CPU-safe contractions, and the C++ decode kernels.

* `einsum_f32`: XLA:CPU's generic dot kernel has no bf16 x bf16 -> f32 (jax 0.10:
  "Unsupported element type for DotThunk::Execute"), which some attention layouts
  reach; a CPU has no bf16 matrix units to lose, so half-precision operands are
  upcast first. The registry builds `attention` and `attention_cached` from the
  reference (`xla.py`) with this contraction.

The C++ decode kernels, built once per machine and called through XLA's FFI from
inside the compiled decode loop (the model's decode step, `rl_jax.models.decode`, through
`Decode` at the end of this file):

* Paged decode attention (`_cpu_attention.cc`). Decoding on CPU is bound by reading
  the KV cache, and XLA:CPU reads it slowly there: the score matmul q @ k of one decode
  step is a batch of [R, hd] x [hd, S] products (R query heads per KV head, 1 or 2
  in many models), which it streams at ~8 GB/s, and it reads every page of a row's
  table whether filled or not. The kernel reads each row's filled positions once,
  page by page.
* Small-M matmul (`_cpu_matmul.cc`): the step's projections and LM head, a few
  dozen rows times each weight matrix, which XLA:CPU runs at under half its
  large-matmul rate; the kernel reads weights packed in panels (`pack_panels`,
  once per decode call), and gate and up side by side (`pack_swiglu_panels`),
  whose SwiGLU activation it computes from its sums (`matmul_swiglu`).

What each buys on a real model: docs/results/performance.md, "CPU kernels".

The shared library is compiled with the host's C++ compiler (`CXX`, default
`c++`) for the host CPU (`-march=native`) and kept in `kernel_cache_dir()`, keyed
by the sources, the flags, the compiler, jaxlib's version and the CPU's
features; a later process loads it in milliseconds. Without a compiler, or with
RL_JAX_CPU_KERNELS=0, `available()` is False and the sampler keeps XLA's
attention and matmuls (same results to float32 rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.kernels import xla
from rl_jax.runtime import user_cache_dir

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = (_HERE / "_cpu_attention.cc", _HERE / "_cpu_matmul.cc")
HEADERS = (_HERE / "_cpu_common.h",)
# FFI target name -> handler symbol in the library.
TARGETS = {
    "rl_jax_paged_attention": "RlJaxPagedAttention",
    "rl_jax_paged_attention_qkv": "RlJaxPagedAttentionQKV",
    "rl_jax_matmul": "RlJaxMatmul",
    "rl_jax_matmul_swiglu": "RlJaxMatmulSwiGLU",
    "rl_jax_matmul_add": "RlJaxMatmulAdd",
    "rl_jax_take_rows": "RlJaxTakeRows",
}
# -fno-math-errno lets floor/max vectorise; no -ffast-math: in a shared library it
# would also set flush-to-zero for the whole process when loaded.
CXX_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC")


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """`xla.einsum_f32` with half-precision operands upcast to float32 first."""
    if a.dtype != jnp.float32 or b.dtype != jnp.float32:
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return xla.einsum_f32(spec, a, b)


def together(fn, *args):
    """`fn(*args)` inside a conditional whose branches are both `fn`: XLA does not move
    work out of a branch, so every output is computed when the call runs, before any
    is read. The LM head's log-probs and entropy (`rl_jax.models.logprobs`): XLA:CPU
    materializes each [B, T, V] operand of a reduction, and its memory scheduler
    deferred the entropy (a metric) to the end of the train step, keeping the float32
    logits alive through the whole backward; inside a branch they die with the
    forward (the SmolLM2 recipe's train step: 773 -> 674 MiB of temporaries, the same
    numbers). The predicate is a value of `args` (either branch gives the same);
    under `vmap` a batched predicate would run both branches."""
    pred = jnp.isfinite(jax.tree.leaves(args)[0].ravel()[0])
    return jax.lax.cond(pred, fn, fn, *args)


def kernel_cache_dir() -> Path:
    """RL_JAX_KERNEL_CACHE if set, else $XDG_CACHE_HOME/rl_jax/kernels (~/.cache)."""
    if os.environ.get("RL_JAX_KERNEL_CACHE"):
        return Path(os.environ["RL_JAX_KERNEL_CACHE"])
    return user_cache_dir("kernels")


def _compiler() -> str | None:
    """CXX if set (and found), else c++ or g++."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("c++") or shutil.which("g++")


def host_cpu() -> str:
    """The host CPU's architecture and feature flags: the library is compiled with
    -march=native, so a cache shared between machines (a network home) must not mix them."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:  # not Linux: the architecture alone
        pass
    return f"{platform.machine()}|{hashlib.sha256(flags.encode()).hexdigest()}"


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    for part in (" ".join(CXX_FLAGS).encode(), version.encode()):
        h.update(part)
    h.update(f"{jax.lib.__version__}|{host_cpu()}".encode())
    return kernel_cache_dir() / f"cpu_kernels-{h.hexdigest()[:20]}.so"


def _build(cxx: str, out: Path) -> None:
    """Compile into a temporary file, then rename: concurrent builders never see half a
    library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *CXX_FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(path: Path) -> ctypes.CDLL:
    """The library, with every handler and the panel width present (AttributeError if not)."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    for symbol in (*TARGETS.values(), "RlJaxMatmulPanelWidth", "RlJaxSwiGLUPanelWidth"):
        getattr(lib, symbol)
    return lib


def _load_library(cxx: str) -> ctypes.CDLL:
    """The cached library, built first if missing; a damaged cache entry (it does not
    load) is built again, once."""
    path = _library_path(cxx)
    if not path.exists():
        _build(cxx, path)
    try:
        return _open(path)
    except (OSError, AttributeError):
        _build(cxx, path)
        return _open(path)


_PANEL_WIDTH: list[int] = []  # set by available(): plain panels, SwiGLU panels


@functools.cache
def available() -> bool:
    """Build (once per machine) and register the kernels; False where they cannot be."""
    if os.environ.get("RL_JAX_CPU_KERNELS", "1") == "0":
        return False
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler (CXX): the sampler keeps XLA's decode kernels on CPU")
        return False
    try:
        lib = _load_library(cxx)
        for target, symbol in TARGETS.items():
            handler = getattr(lib, symbol)
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:
        log.warning("CPU decode kernels unavailable (%s); using XLA's", e)
        return False
    _PANEL_WIDTH[:] = [int(lib.RlJaxMatmulPanelWidth()), int(lib.RlJaxSwiGLUPanelWidth())]
    return True


def panel_width() -> int:
    """Columns per panel of `pack_panels` (48 with AVX-512, 16 with AVX2: the matmul
    kernel's register tile). Call only after `available()` returned True."""
    return _widths()[0]


def _widths() -> list[int]:
    if not _PANEL_WIDTH:
        raise RuntimeError("the CPU kernels are not loaded: call available() first")
    return _PANEL_WIDTH


def _panels(w: jax.Array, width: int) -> jax.Array:
    """w [K, N] -> float32 [K, ceil(N / width), width]: its columns in groups of `width`,
    the last zero-padded."""
    K, N = w.shape
    P = -(-N // width)
    return jnp.pad(w.astype(jnp.float32), ((0, 0), (0, P * width - N))).reshape(K, P, width)


def pack_panels(w: jax.Array) -> jax.Array:
    """w [K, N] -> float32 panels [ceil(N / NR), K, NR] for `matmul` (NR = panel_width()):
    columns p * NR .. (p + 1) * NR - 1 of w, contiguous, the last panel zero-padded."""
    return _panels(w, panel_width()).transpose(1, 0, 2)


def pack_swiglu_panels(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gate, up [K, F] -> float32 panels [ceil(F / h), K, 2h] for `matmul_swiglu`
    (h: one vector, 16 floats with AVX-512): panel p holds gate columns
    p * h .. (p + 1) * h - 1, then the same up columns, the last zero-padded."""
    h = _widths()[1] // 2
    return jnp.concatenate([_panels(gate, h), _panels(up, h)], axis=2).transpose(1, 0, 2)


def _f32(shape) -> jax.ShapeDtypeStruct:
    """A kernel's result of `shape` (every result is float32)."""
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _panel_call(target: str, out, x, panels, layer, *rest, aliases=None, **attrs):
    """The kernel `target` on x, the panels (stacked over layers or not: `_stack`), the
    layer and `rest`, every array in float32; `out`: its results' shapes."""
    f32 = jnp.float32
    panels, layer = _stack(panels, layer)
    call = jax.ffi.ffi_call(target, out, input_output_aliases=aliases)
    return call(x.astype(f32), panels, layer, *(a.astype(f32) for a in rest), **attrs)


def matmul_swiglu(
    x: jax.Array,
    panels: jax.Array,
    cols: int,
    parallel: bool = True,
    norm_eps: float | None = None,
    layer=None,
) -> jax.Array:
    """SwiGLU's activation silu(x @ gate) * (x @ up), [M, cols] float32, from
    `pack_swiglu_panels(gate, up)`: computed from the kernel's accumulators, with no
    pre-activations written out and no elementwise pass over them (+6% generation
    on the bench model, paired runs). `norm_eps`: as for `matmul`. Same conditions
    as `matmul`."""
    M = x.shape[0]
    # The kernel's scratch [M, P W] (P panels of W columns), and the activation.
    out = (_f32((M, panels.shape[-3] * panels.shape[-1])), _f32((M, cols)))
    attrs = {"parallel": bool(parallel), "norm_eps": _eps(norm_eps)}
    return _panel_call("rl_jax_matmul_swiglu", out, x, panels, layer, **attrs)[1]


def _stack(panels: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """Panels stacked over layers [L, P, K, W] and the layer to use: a single matrix's
    panels [P, K, W] become a stack of one (layer 0)."""
    if panels.ndim == 3:
        return panels[None], jnp.int32(0)
    if layer is None:
        raise ValueError(f"panels stacked over layers {panels.shape} need a layer")
    return panels, jnp.asarray(layer, jnp.int32)


def _eps(norm_eps: float | None) -> np.float32:
    return np.float32(-1.0 if norm_eps is None else norm_eps)  # < 0: no norm


def matmul(
    x: jax.Array,
    panels: jax.Array,
    cols: int,
    parallel: bool = True,
    norm_eps: float | None = None,
    layer=None,
) -> jax.Array:
    """x [M, K] @ w [K, cols] in float32, w given as `pack_panels(w)`.

    layer: with panels stacked over layers [L, P, K, NR], the (traced) layer whose
    weights to use, read in place (a decode step's scan over layers slices nothing).

    norm_eps: x is an RMSNorm's input and the panels hold `norm_weight[:, None] * w`;
    the result is RMSNorm(x) @ w, the rows' 1 / rms computed in the kernel and
    applied to the sums.

    Call only after `available()` returned True, and on arrays local to one device
    (no mesh, or inside shard_map): the call has no sharding rule. `parallel`: also
    use XLA's intra-op threads (as for `paged_attention`).
    """
    attrs = {"parallel": bool(parallel), "norm_eps": _eps(norm_eps)}
    return _panel_call("rl_jax_matmul", _f32((x.shape[0], cols)), x, panels, layer, **attrs)


def matmul_add(
    x: jax.Array, panels: jax.Array, residual: jax.Array, parallel: bool = True, layer=None
) -> jax.Array:
    """residual + x @ w in float32 (w as `pack_panels(w)`, residual [M, N]), summed in
    place in the residual's buffer: a decoder layer's o and down projections with
    their residual connection. Same conditions as `matmul`."""
    args = (_f32(residual.shape), x, panels, layer, residual)
    return _panel_call("rl_jax_matmul_add", *args, aliases={3: 0}, parallel=bool(parallel))


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] for a float32 table [V, D] and ids [B] (out-of-range ids clipped): a
    step's token embeddings, every row requested before any is copied. Same
    conditions as `matmul`."""
    call = jax.ffi.ffi_call("rl_jax_take_rows", _f32((ids.shape[0], table.shape[1])))
    return call(table.astype(jnp.float32), ids.astype(jnp.int32))


def paged_attention(
    inputs: tuple[jax.Array, jax.Array, jax.Array],
    keys: jax.Array,
    values: jax.Array,
    table: jax.Array,
    pos: jax.Array,
    live: jax.Array,
    layer,
    scale: float,
    parallel: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer's decode attention over a paged cache (`xla.PagedKV`; keys in tiles,
    [K, L, N, P / 16, hd, 16], values [K, L, N, P, hd], float32): row b's key and value
    written at its position pos[b] of its pages (table [B, R]) of `layer` where
    live[b], then softmax(scale * q k^T) v over its positions 0 .. pos[b] (zeros where
    not live). `inputs`: (q [B, K, R, hd], k, v [B, K, hd]), RoPE applied, or the
    projection's rows [B, (H + 2K) hd] (query heads, key heads, value heads) with
    RoPE's angles cos, sin [B, hd / 2], split and rotated in the kernel. Returns
    (attention [B, K, R, hd] or [B, H hd], keys, values), float32; the cache is updated
    in place (the results alias keys and values; XLA copies them first only where the
    inputs are still needed).

    Call only after `available()` returned True, and on arrays local to one device
    (no mesh, or inside shard_map): the call has no sharding rule. `parallel`: also
    use XLA's intra-op threads (one device on the host); with one device per core
    each device's call keeps to its own thread (bench model, 64 rows: 16% faster
    generation on one device with the threads, per core no faster with them)."""
    fused = inputs[0].ndim == 2
    B = table.shape[0]
    if fused:
        K, hd = keys.shape[0], keys.shape[-2]
        out_shape, target = (B, inputs[0].shape[1] - 2 * K * hd), "rl_jax_paged_attention_qkv"
    else:
        out_shape, target = inputs[0].shape, "rl_jax_paged_attention"
    f32, i32 = jnp.float32, jnp.int32
    outs = (_f32(out_shape), _f32(keys.shape), _f32(values.shape))
    call = jax.ffi.ffi_call(target, outs, input_output_aliases={3: 1, 4: 2})
    return call(
        *(x.astype(f32) for x in inputs),
        keys,
        values,
        table.astype(i32),
        pos.astype(i32),
        live.astype(i32),
        jnp.asarray(layer, i32),
        scale=np.float32(scale),
        parallel=bool(parallel),
    )


# ---- the decode step's ops (rl_jax.models.decode) ---------------------------------------

# Slots per key tile of the attention kernel's layout: its vector width (kLanes in
# _cpu_attention.cc).
KEY_TILE = 16


class Decode(xla.Decode):
    """The decode step's ops in the C++ kernels, each part where it applies (the rest
    `xla.Decode`'s, long tables in blocks).

    `attention`: the paged cache's keys in tiles of KEY_TILE positions, [K, L, N,
    P / KEY_TILE, hd, KEY_TILE], one contiguous block per tile, values [K, L, N, P, hd];
    one kernel call per layer writes the step's key and value and computes the
    attention in the layer's pages, in place: it reads each row's filled positions
    once, front to back, so no blocks are needed at any length. Without a q/k norm the
    call also splits the projection's rows and applies RoPE (`paged_attention`).

    `matmul`: the weights packed once per decode call (`prepare`): q/k/v, o and down
    projections and the transposed LM head into panels of columns (`pack_panels`),
    gate and up side by side into SwiGLU panels (`pack_swiglu_panels`), whose
    activation the kernel computes from its sums, the norms' weights folded in (the
    kernels apply 1 / rms). The kernels take the whole stack and the scan's layer
    index, and read that layer's panels in place (no copy per layer). Packing copies
    every weight once per decode call.

    `threads`: whether the kernels may use XLA's intra-op threads (one device decodes).
    """

    def __init__(self, *, attention: bool, matmul: bool, threads: bool):
        super().__init__("cpu", einsum=einsum_f32)
        self.tiled, self.packed, self.threads = attention, matmul, threads
        self.platform_ops = ("attention",) * attention + ("matmul",) * matmul
        if attention:  # pages of whole key tiles
            self.page_multiple = KEY_TILE

    def paged_shapes(self, *, quantized=False, **geometry) -> xla.PagedKV:
        shapes = super().paged_shapes(quantized=quantized, **geometry)
        if not self.tiled or quantized:  # the kernel reads float32 pages
            return shapes
        *lead, page, head_dim = shapes.keys.shape  # [K, L, N, P, hd]
        keys = (*lead, page // KEY_TILE, head_dim, KEY_TILE)
        return shapes._replace(keys=jax.ShapeDtypeStruct(keys, shapes.keys.dtype))

    def page_keys(self, keys: jax.Array, cache: xla.PagedKV) -> jax.Array:
        if cache.keys.ndim != 6:  # not in tiles
            return keys
        *lead, P, hd = keys.shape  # [..., P, hd] -> [..., P / KEY_TILE, hd, KEY_TILE]
        return keys.reshape(*lead, P // KEY_TILE, KEY_TILE, hd).swapaxes(-1, -2)

    def paged_axes(self, cache: xla.PagedKV) -> xla.PagedKV:
        axes = super().paged_axes(cache)
        if cache.keys.ndim == 6:  # keys in tiles
            return axes._replace(keys=(*xla.PAGED_LOGICAL_AXES[:4], "head_dim", None))
        return axes

    def paged_attention(
        self, qkv, rope, cache, pages, pos_b, *, layer, num_heads, qk_norm=None, eps=0.0
    ):
        if not self.tiled or cache.scales is not None:
            return super().paged_attention(
                qkv,
                rope,
                cache,
                pages,
                pos_b,
                layer=layer,
                num_heads=num_heads,
                qk_norm=qk_norm,
                eps=eps,
            )
        hd = cache.values.shape[-1]
        cos, sin = rope
        if qk_norm is None:  # split, rotate, write, attend: all in the kernel
            inputs = (qkv, cos[:, 0], sin[:, 0])
        else:
            q, k, v = self.split_heads(qkv, rope, num_heads, cache, layer, qk_norm, eps)
            B, K = q.shape[:2]
            inputs = (q, k.reshape(B, K, hd), v.reshape(B, K, hd))
        att, keys, values = paged_attention(
            inputs,
            cache.keys,
            cache.values,
            pages.table,
            pos_b,
            pages.live,
            layer,
            hd**-0.5,
            self.threads,
        )
        return att, xla.PagedKV(keys, values)

    def prepare(self, layers: dict, final_norm: jax.Array, head_vd: jax.Array):
        if not self.packed:
            return super().prepare(layers, final_norm, head_vd)

        def one_layer(w):
            attn_w = w["attn_norm"].astype(w["qkv"].dtype)[:, None]
            return w | {"qkv": pack_panels(attn_w * w["qkv"]), "o": pack_panels(w["o"])}

        norm_w = final_norm.astype(jnp.float32)[:, None]
        head = pack_panels(norm_w * head_vd.T.astype(jnp.float32))
        return jax.vmap(one_layer)(layers), head

    def prepare_mlp(self, mlp: dict) -> dict:
        if not self.packed or "gate_up" not in mlp:  # experts keep XLA's layout and ops
            return mlp

        def one_layer(w):
            norm_w = w["mlp_norm"].astype(w["gate_up"].dtype)[:, None]
            gate, up = jnp.split(w["gate_up"], 2, axis=1)
            packed = pack_swiglu_panels(norm_w * gate, norm_w * up)
            return w | {"gate_up": packed, "down": pack_panels(w["down"])}

        return jax.vmap(one_layer)(mlp)

    def embed(self, table_vd, tokens_b, dtype):
        if self.packed:
            return take_rows(table_vd, tokens_b)
        return super().embed(table_vd, tokens_b, dtype)

    def normed_dense(self, x, norm, w, layer, *, eps, cols):
        if self.packed:  # the norm in the kernel, its weight in the panels
            return matmul(x, w, cols, self.threads, norm_eps=eps, layer=layer)
        return super().normed_dense(x, norm, w, layer, eps=eps, cols=cols)

    def swiglu(self, x, norm, w, layer, *, eps, cols):
        if self.packed:
            return matmul_swiglu(x, w, cols, self.threads, norm_eps=eps, layer=layer)
        return super().swiglu(x, norm, w, layer, eps=eps, cols=cols)

    def residual_dense(self, r, x, w, layer, bias=None):
        if self.packed:  # summed in place in the residual's buffer
            r = r if bias is None else r + bias
            return matmul_add(x, w, r, self.threads, layer=layer)
        return super().residual_dense(r, x, w, layer, bias)

    def logits(self, x, norm, head, *, eps, dtype, cols):
        if self.packed:  # the final norm and the head in the kernel
            return matmul(x, head, cols, self.threads, norm_eps=eps)
        return super().logits(x, norm, head, eps=eps, dtype=dtype, cols=cols)


def decode_ops(
    platform: str,
    *,
    compute_dtype,
    head_dim: int,
    local: bool,
    threads: bool,
    attention: bool = True,
    matmul: bool = True,
) -> xla.Decode:
    """The decode step's ops on CPU. The kernels apply in float32, where each device
    decodes its rows alone (`local`: no mesh, one device, or rows split over all
    devices; the calls have no sharding rule) and where they can be built
    (`available()`; RL_JAX_CPU_KERNELS=0 turns them off); the attention kernel with
    head dimensions in whole vectors of KEY_TILE floats. `attention` / `matmul` False
    keep XLA's for that part (comparisons). Elsewhere: XLA's ops, long tables in blocks."""
    applies = jnp.dtype(compute_dtype) == jnp.float32 and local and available()
    tiled = attention and applies and head_dim % KEY_TILE == 0
    packed = matmul and applies
    if not (tiled or packed):
        return xla.Decode(platform, einsum=einsum_f32)
    return Decode(attention=tiled, matmul=packed, threads=threads)
