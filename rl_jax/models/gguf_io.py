"""GGUF files (llama.cpp) for the Llama / Qwen2 / Qwen3 families.

A small reader of the container (metadata and tensor table; the tensor bytes
stay memory-mapped) plus `gguf`'s dequantizers. `gguf.GGUFReader` would do
too, but it builds a Python object per vocabulary entry and takes seconds on a
50k vocabulary; reading the metadata here takes milliseconds.

llama.cpp's converter permutes the rows of Llama's Q and K projections from
HF's "rotate half" RoPE layout into interleaved pairs; the loader undoes that,
so the tensors handed to the HF-layout loader are exactly HF's.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.config.model import ModelConfig
from rl_jax.models.hf import CheckpointError, hf_views, model_from_views
from rl_jax.models.spec import ModelSpec, spec_from_fields
from rl_jax.models.transformer import Transformer

_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
ARCHS = ("llama", "qwen2", "qwen3")


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, tuple[tuple[int, ...], int, int]]  # name -> (numpy shape, type, offset)
    data_start: int

    def raw(self, name: str) -> tuple[np.ndarray, int]:
        """The stored bytes of a tensor as uint8 rows, and its GGML type."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        shape, qtype, offset = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        row_bytes = shape[-1] // block * type_size
        n_bytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self.data_start + offset
        return mm[start : start + n_bytes].reshape(*shape[:-1], row_bytes), qtype

    def array(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32 (numpy layout: HF's [out, in] for matrices)."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        data, qtype = self.raw(name)
        out = dequantize(data, GGMLQuantizationType(qtype))
        return np.asarray(out, np.float32).reshape(self.tensors[name][0])


class _Buf:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def unpack(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.data):
            raise struct.error("string past the end of the buffer")  # read more, or cut short
        s = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALAR:  # numeric arrays in one read
                fmt = _SCALAR[item]
                if self.pos + count * struct.calcsize(fmt) > len(self.data):
                    raise struct.error("array past the end of the buffer")
                arr = np.frombuffer(self.data, np.dtype(fmt), count, self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self.value(item) for _ in range(count)]
        return self.unpack(_SCALAR[vtype])


@functools.lru_cache(maxsize=4)
def _read_cached(path: str, mtime: float) -> GGUFFile:
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF":
            raise CheckpointError(f"{p} is not a GGUF file (magic {head[:4]!r})")
        if len(head) < 24:
            raise CheckpointError(
                f"{p} is cut short: {size} bytes, less than a GGUF header (an interrupted "
                "download or copy?)"
            )
        version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
        if version < 2:
            raise CheckpointError(f"{p}: GGUF version {version} is too old (need >= 2)")
        # Metadata + tensor table are small next to the data; read generously, once.
        chunk = 1 << 22
        while True:
            f.seek(0)
            buf = _Buf(f.read(min(chunk, size)))
            buf.pos = 24
            try:
                meta, tensors = _read_tables(buf, n_kv, n_tensors)
                break
            except struct.error:
                if chunk >= size:
                    raise CheckpointError(
                        f"{p} is cut short or damaged: its header ends past the file's "
                        f"{size} bytes (an interrupted download or copy?)"
                    ) from None
                chunk *= 4
            except (KeyError, ValueError, OverflowError, MemoryError) as e:
                raise CheckpointError(f"{p}: damaged GGUF header ({type(e).__name__})") from None
    try:
        align = int(meta.get("general.alignment", 32))
    except (TypeError, ValueError):
        align = 0
    if align <= 0:
        raise CheckpointError(f"{p}: general.alignment={meta['general.alignment']!r} is not > 0")
    data_start = -(-buf.pos // align) * align
    return GGUFFile(p, meta, tensors, data_start)


def _read_tables(buf: _Buf, n_kv: int, n_tensors: int) -> tuple[dict, dict]:
    meta = {}
    for _ in range(n_kv):
        key = buf.string()
        meta[key] = buf.value(buf.unpack("<I"))
    tensors = {}
    for _ in range(n_tensors):
        name = buf.string()
        n_dims = buf.unpack("<I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [buf.unpack("<Q") for _ in range(n_dims)]
        qtype, offset = buf.unpack("<I"), buf.unpack("<Q")
        tensors[name] = (tuple(reversed(dims)), qtype, offset)
    return meta, tensors


def read_gguf(path: str | Path) -> GGUFFile:
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"GGUF file {p} does not exist")
    return _read_cached(str(p.resolve()), p.stat().st_mtime)


def check_gguf_tensors(path: str | Path, names=None) -> GGUFFile:
    """Every tensor (or those `names`) has a known GGML type and lies inside the file: a
    file cut short (an interrupted download) is named here, not by a failed read later."""
    g = read_gguf(path)
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        raise CheckpointError(
            f"{path}: reading GGUF weights needs the gguf package (pip install gguf)"
        ) from None
    size = g.path.stat().st_size
    for name in g.tensors if names is None else names:
        shape, qtype, offset = g.tensors[name]
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has GGML type {qtype}, which gguf "
                "does not know (a newer file, or a damaged one)"
            ) from None
        if not shape or any(d <= 0 for d in shape) or shape[-1] % block:
            raise CheckpointError(f"{path}: tensor {name!r} has a bad shape {shape}")
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        end = g.data_start + offset + rows * (shape[-1] // block * type_size)
        if end > size:
            raise CheckpointError(
                f"{path} is cut short: tensor {name!r} ends at byte {end} but the file has "
                f"{size} bytes (an interrupted download or copy?)"
            )
    return g


def spec_fields_from_gguf(path: str | Path) -> dict[str, Any]:
    try:
        return _spec_fields(path)
    except KeyError as e:
        raise CheckpointError(f"{path}: GGUF metadata lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{path}: GGUF metadata value is not a number ({e})") from None


def _spec_fields(path: str | Path) -> dict[str, Any]:
    g = read_gguf(path)
    m = g.metadata
    arch = m.get("general.architecture")
    if arch not in ARCHS:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; rl_jax loads {list(ARCHS)}"
        )
    if "rope_freqs.weight" in g.tensors or m.get(f"{arch}.rope.scaling.type", "none") != "none":
        raise CheckpointError(
            f"{path}: RoPE scaling in GGUF form is not supported; load the HF directory instead"
        )
    D = int(m[f"{arch}.embedding_length"])
    H = int(m[f"{arch}.attention.head_count"])
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(g.tensors["token_embd.weight"][0][0]),
        hidden_size=D,
        intermediate_size=int(m[f"{arch}.feed_forward_length"]),
        num_layers=int(m[f"{arch}.block_count"]),
        num_heads=H,
        num_kv_heads=int(m.get(f"{arch}.attention.head_count_kv", H)),
        rope_theta=float(m.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=int(m.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=float(m[f"{arch}.attention.layer_norm_rms_epsilon"]),
        tie_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_output.bias" in g.tensors,
        bos_token_id=int(m.get("tokenizer.ggml.bos_token_id", -1)),
        eos_token_ids=(
            (int(m["tokenizer.ggml.eos_token_id"]),) if "tokenizer.ggml.eos_token_id" in m else ()
        ),
        pad_token_id=int(m.get("tokenizer.ggml.padding_token_id", -1)),
    )
    key_len = m.get(f"{arch}.attention.key_length")
    if key_len and int(key_len) != D // H:
        fields["head_dim"] = int(key_len)
    return fields


_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _NAMES:
        return f"model.layers.{parts[1]}.{_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """HF name -> HF-layout shape of the file's tensors, each checked to lie inside the file
    (`check_gguf_tensors`); reads no tensor."""
    g = check_gguf_tensors(path)
    return {hf_name(n): shape for n, (shape, _, _) in g.tensors.items() if hf_name(n)}


def gguf_hf_tensors(path: str | Path, spec: ModelSpec) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under HF names and in HF layouts."""
    g = check_gguf_tensors(path)
    out = {}
    for name in g.tensors:
        hf = hf_name(name)
        if hf is None:
            continue
        w = g.array(name)
        if spec.architecture == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rows(w, spec.num_heads)
        elif spec.architecture == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rows(w, spec.num_kv_heads)
        out[hf] = w
    return out


def load_gguf(
    path: str | Path,
    spec: ModelSpec | None = None,
    *,
    mesh=None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
) -> Transformer:
    """A GGUF file's weights, dequantized, in a (sharded) model (`spec` default: the file's)."""
    if spec is None:
        fields = spec_fields_from_gguf(path)
        spec = spec_from_fields(ModelConfig(path=str(path)), fields, f"GGUF file {Path(path)}")
    views = hf_views(spec, gguf_hf_tensors(path, spec), where=str(path))
    return model_from_views(spec, views, mesh=mesh, rules_preset=rules_preset, purpose=purpose)
