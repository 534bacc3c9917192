"""HF-format checkpoints (Llama / Qwen2 / Qwen3 / Qwen3-MoE): config.json, safetensors, export.

Loading fills each device's shard straight from memory-mapped host tensors
(`jax.make_array_from_callback`), so no device ever holds a full copy of a
sharded parameter. Both config.json spellings are read: transformers 4.x
(`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x (`rope_parameters`,
`dtype`). Export writes the 4.x spelling, which both generations load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rl_jax.config.model import ModelConfig
from rl_jax.knobs import ConfigError
from rl_jax.knobs import read_json_object as _read_json_object
from rl_jax.models.safetensors_io import open_safetensors, write_safetensors
from rl_jax.models.spec import ModelSpec, RopeScaling, spec_from_fields
from rl_jax.models.transformer import (
    LAYER_PARAMS,
    Transformer,
    build_model,
    dtype_of,
    host_params,
    param_layout,
    param_shardings,
)
from rl_jax.sharding.rules import get_rules


class CheckpointError(ConfigError):
    """A checkpoint does not match what the model needs (names the tensor/shape/field)."""


HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# A family with a sparse MLP, (model_type, class): Qwen3-MoE (Qwen3's attention, no shared
# expert) and Qwen2-MoE (Qwen2's attention, a shared expert beside the routed ones).
MOE_HF = {
    "qwen3": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}
ARCH_BY_MODEL_TYPE = {a: a for a in HF_CLASS} | {t: a for a, (t, _) in MOE_HF.items()}
ARCH_BY_CLASS = {c: a for a, c in HF_CLASS.items()} | {c: a for a, (_, c) in MOE_HF.items()}
# A model directory's tokenizer: the fast tokenizer and its settings, the chat template
# where transformers 5 writes it, the slow tokenizers' vocabularies. Copied as they are by
# an export, so every field transformers reads travels.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


# ---- config.json ---------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> dict[str, Any]:
    f = Path(path) / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path} is not an HF model directory: no config.json")
    return read_json_object(f)


def read_json_object(f: Path) -> dict[str, Any]:
    """A JSON file holding one object; anything else is a CheckpointError naming the file."""
    return _read_json_object(f, CheckpointError)


def _int(cfg: Mapping[str, Any], key: str, where: str, default: Any = None) -> int:
    """An integer field of config.json ('64' or 64.5 named as the culprit, not a traceback)."""
    value = cfg.get(key, default)
    if value is None:
        raise CheckpointError(f"{where}: missing {key!r} (an integer)")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{where}: {key}={value!r} must be an integer")
    return value


def _float(cfg: Mapping[str, Any], key: str, where: str, default: Any = None) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(f"{where}: {key}={value!r} must be a finite number")
    return float(value)


def _bool(cfg: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    """A boolean field of config.json: JSON true/false, absent the default, null false (as
    transformers reads it). A string such as "false" is refused, not read as true."""
    value = cfg.get(key, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key}={value!r} must be true or false")
    return value


def _ids(value, key: str, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(_int({key: v}, key, where) for v in values)


# ModelSpec fields that config.json holds one to one, both ways: (field, key).
_SIZES = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "hidden_size"),
    ("intermediate_size", "intermediate_size"),
    ("num_layers", "num_hidden_layers"),
    ("num_heads", "num_attention_heads"),
)
_MOE_SIZES = (
    ("num_experts_per_tok", "num_experts_per_tok"),
    ("moe_intermediate_size", "moe_intermediate_size"),
)
_LLAMA3_ROPE = (  # RopeScaling field, rope_scaling key, how it reads
    ("factor", "factor", _float),
    ("low_freq_factor", "low_freq_factor", _float),
    ("high_freq_factor", "high_freq_factor", _float),
    ("original_max_position", "original_max_position_embeddings", _int),
)


def spec_fields_from_hf_config(cfg: Mapping[str, Any], where: str = "config.json") -> dict:
    """ModelSpec fields (architecture level) from an HF config dict, 4.x or 5.x spelling."""
    arch = _architecture(cfg, where)
    H = _int(cfg, "num_attention_heads", where)
    has = lambda key: cfg.get(key) not in (None, 0)  # noqa: E731 - absent, null or 0: default
    token = lambda key: -1 if cfg.get(key) is None else _int(cfg, key, where)  # noqa: E731
    theta, scaling = _rope(cfg, where)
    fields: dict[str, Any] = dict(
        architecture=arch,
        **{field: _int(cfg, key, where) for field, key in _SIZES},
        num_kv_heads=_int(cfg, "num_key_value_heads", where) if has("num_key_value_heads") else H,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=(
            _int(cfg, "max_position_embeddings", where) if has("max_position_embeddings") else 2048
        ),
        rms_norm_eps=_float(cfg, "rms_norm_eps", where, 1e-6),
        tie_embeddings=_bool(cfg, "tie_word_embeddings", where, arch != "llama"),
        attention_bias=_bool(cfg, "attention_bias", where, False),
        bos_token_id=token("bos_token_id"),
        eos_token_ids=_ids(cfg.get("eos_token_id"), "eos_token_id", where),
        pad_token_id=token("pad_token_id"),
    )
    if cfg.get("head_dim"):
        fields["head_dim"] = _int(cfg, "head_dim", where)
    moe = {name for pair in MOE_HF.values() for name in pair}  # model types and classes
    if moe & {cfg.get("model_type"), *(cfg.get("architectures") or [])}:
        fields.update(_moe_fields(cfg, fields["num_layers"], where))
    return fields


def _architecture(cfg: Mapping[str, Any], where: str) -> str:
    """rl_jax's architecture of an HF config; what it cannot load refused."""
    model_type = cfg.get("model_type")
    classes = cfg.get("architectures") or []
    if not isinstance(model_type, str | None):
        raise CheckpointError(f"{where}: model_type={model_type!r} must be a string")
    if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise CheckpointError(f"{where}: architectures={classes!r} must be a list of class names")
    arch = ARCH_BY_MODEL_TYPE.get(model_type) or next(
        (ARCH_BY_CLASS[c] for c in classes if c in ARCH_BY_CLASS), None
    )
    if arch is None:
        raise CheckpointError(
            f"{where}: architecture model_type={model_type!r} architectures={classes} is not "
            f"supported; rl_jax loads model_type in {sorted(ARCH_BY_MODEL_TYPE)} "
            f"({', '.join(HF_CLASS.values())})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"{where}: hidden_act={cfg['hidden_act']!r}; only 'silu' is supported"
        )
    if _bool(cfg, "mlp_bias", where, False):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    if _bool(cfg, "use_sliding_window", where, False):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
    return arch


def _rope(cfg: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """Rotary theta and scaling. 5.x: rope_parameters holds both; 4.x: rope_theta and
    rope_scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise CheckpointError(f"{where}: {key}={cfg[key]!r} must be an object or null")
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k not in rope})
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    theta = _float({"rope_theta": theta}, "rope_theta", where)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(
            f"{where}: rope_type={rope_type!r} is not supported (supported: default, llama3)"
        )
    at = f"{where} rope_scaling"
    values = {field: read(rope, key, at) for field, key, read in _LLAMA3_ROPE}
    try:
        return theta, RopeScaling(**values)
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


def _moe_fields(cfg: Mapping[str, Any], num_layers: int, where: str) -> dict:
    """A Qwen3-MoE or Qwen2-MoE config's expert fields. transformers 5 writes
    `num_experts` as `num_local_experts`. Layer i is sparse when (i + 1) %
    decoder_sparse_step == 0 and i is not in mlp_only_layers (every layer of every
    published Qwen3-MoE and Qwen2-MoE), else dense (`ModelSpec.dense_layers`)."""
    key = "num_experts" if "num_experts" in cfg else "num_local_experts"
    E = _int(cfg, key, where, 0)
    if not E:
        return {}
    step = _int(cfg, "decoder_sparse_step", where, 1)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise CheckpointError(f"{where}: mlp_only_layers={only!r} must be a list of layer indices")
    if step < 1:
        raise CheckpointError(f"{where}: decoder_sparse_step={step} must be >= 1")
    dense = tuple(i for i in range(num_layers) if (i + 1) % step or i in only)
    if len(dense) == num_layers:
        raise CheckpointError(
            f"{where}: decoder_sparse_step={step} mlp_only_layers={only} leave no sparse "
            f"layer of {num_layers}; load it as a dense model (num_experts=0)"
        )
    return dict(
        dense_layers=dense,
        num_experts=E,
        **{field: _int(cfg, key, where) for field, key in _MOE_SIZES},
        norm_topk_prob=_bool(cfg, "norm_topk_prob", where, False),
        shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size", where, 0),
    )


def spec_fields_from_hf_dir(path: str | Path) -> dict:
    return spec_fields_from_hf_config(read_hf_config(path), where=f"{path}/config.json")


def hf_config_from_spec(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """config.json in the transformers 4.x spelling (5.x reads it too)."""
    eos = spec.eos_token_ids
    cfg: dict[str, Any] = {
        "architectures": [HF_CLASS[spec.architecture]],
        "model_type": spec.architecture,
        **{key: getattr(spec, field) for field, key in _SIZES},
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": spec.bos_token_id if spec.bos_token_id >= 0 else None,
        "eos_token_id": (None if not eos else eos[0] if len(eos) == 1 else list(eos)),
        "pad_token_id": spec.pad_token_id if spec.pad_token_id >= 0 else None,
    }
    if spec.rope_scaling is not None:
        r = spec.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            **{key: getattr(r, field) for field, key, _ in _LLAMA3_ROPE},
        }
    cfg.update(_bias_keys(spec))
    if spec.is_moe:
        cfg.update(_moe_keys(spec))
    return cfg


def _bias_keys(spec: ModelSpec) -> dict[str, Any]:
    """config.json's spelling of the attention's biases and norms (what has none refused)."""
    out: dict[str, Any] = {}
    if spec.architecture == "qwen2":
        if not spec.qkv_bias or spec.o_bias:
            raise CheckpointError("qwen2 checkpoints have q/k/v biases and no o_proj bias")
        out["use_sliding_window"] = False
    else:
        if spec.qkv_bias != spec.o_bias:
            raise CheckpointError(
                f"{spec.architecture}: attention_bias covers q/k/v and o together; "
                f"got qkv_bias={spec.qkv_bias} o_bias={spec.o_bias}"
            )
        out["attention_bias"] = spec.qkv_bias
    if spec.architecture == "llama":
        out["mlp_bias"] = False
    if spec.qk_norm != (spec.architecture == "qwen3"):
        raise CheckpointError(f"{spec.architecture}: qk_norm={spec.qk_norm} has no HF spelling")
    return out


def _moe_keys(spec: ModelSpec) -> dict[str, Any]:
    """config.json's keys of a mixture of experts: Qwen3-MoE (model.architecture=qwen3, no
    shared expert) or Qwen2-MoE (qwen2, with one); what has no HF spelling refused."""
    shared = spec.shared_expert_intermediate_size
    if spec.architecture not in MOE_HF or bool(shared) != (spec.architecture == "qwen2"):
        raise CheckpointError(
            "a mixture of experts exports as Qwen3-MoE (model.architecture=qwen3, no shared "
            "expert) or Qwen2-MoE (qwen2, model.shared_expert_intermediate_size > 0); "
            f"model.architecture={spec.architecture} with "
            f"shared_expert_intermediate_size={shared} has no HF spelling"
        )
    model_type, cls = MOE_HF[spec.architecture]
    return dict(
        architectures=[cls],
        model_type=model_type,
        num_experts=spec.num_experts,
        **{key: getattr(spec, field) for field, key in _MOE_SIZES},
        norm_topk_prob=spec.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=list(spec.dense_layers),
        use_sliding_window=False,
        **({"shared_expert_intermediate_size": shared} if shared else {}),
    )


# ---- tensor names and layouts ------------------------------------------------------------------


@dataclass(frozen=True)
class _Conv:
    """One of our parameters in HF terms: a name (per layer: a format with {i}) and views."""

    hf_name: str
    to_ours: Callable[[np.ndarray], np.ndarray]  # HF tensor -> our (per-layer) layout, a view
    to_hf: Callable[[np.ndarray], np.ndarray]  # our (per-layer) array -> HF layout
    hf_shape: tuple[int, ...]
    # One HF tensor per expert ({j} in hf_name); ours stacks them [L, E, ...].
    experts: int = 0
    mlp: str = ""  # an MLP's, "dense" or "sparse": stacked over the layers of that kind

    def layers(self, spec: ModelSpec) -> tuple[int, ...]:
        """The layers this parameter is stacked over."""
        if self.mlp == "sparse":
            return spec.sparse_layers
        if self.mlp == "dense":
            return tuple(i for i in range(spec.num_layers) if i not in spec.sparse_layers)
        return tuple(range(spec.num_layers))

    def names(self, spec: ModelSpec) -> list[str]:
        """Every HF tensor name of this parameter, in our stacking order (layers, experts)."""
        if "{i}" not in self.hf_name:
            return [self.hf_name]
        js = range(self.experts) if self.experts else [None]
        return [self.hf_name.format(i=i, j=j) for i in self.layers(spec) for j in js]


def hf_layout(spec: ModelSpec) -> dict[str, _Conv]:
    """Our parameter name -> its HF tensor name and layout conversion."""
    D, F, V = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    H, K, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    ident = lambda a: a  # noqa: E731
    T = lambda a: a.T  # noqa: E731

    def proj(n):  # [n*hd, D] <-> [D, n, hd]
        return dict(
            to_ours=lambda a: a.reshape(n, hd, D).transpose(2, 0, 1),
            to_hf=lambda a: a.transpose(1, 2, 0).reshape(n * hd, D),
            hf_shape=(n * hd, D),
        )

    def bias(n):  # [n*hd] <-> [n, hd]
        return dict(
            to_ours=lambda a: a.reshape(n, hd),
            to_hf=lambda a: a.reshape(n * hd),
            hf_shape=(n * hd,),
        )

    p = "model.layers.{i}."
    table = {
        "embed": _Conv("model.embed_tokens.weight", ident, ident, (V, D)),
        "final_norm": _Conv("model.norm.weight", ident, ident, (D,)),
        "lm_head": _Conv("lm_head.weight", ident, ident, (V, D)),
        "attn_norm": _Conv(p + "input_layernorm.weight", ident, ident, (D,)),
        "mlp_norm": _Conv(p + "post_attention_layernorm.weight", ident, ident, (D,)),
        "q": _Conv(p + "self_attn.q_proj.weight", **proj(H)),
        "k": _Conv(p + "self_attn.k_proj.weight", **proj(K)),
        "v": _Conv(p + "self_attn.v_proj.weight", **proj(K)),
        "q_bias": _Conv(p + "self_attn.q_proj.bias", **bias(H)),
        "k_bias": _Conv(p + "self_attn.k_proj.bias", **bias(K)),
        "v_bias": _Conv(p + "self_attn.v_proj.bias", **bias(K)),
        "q_norm": _Conv(p + "self_attn.q_norm.weight", ident, ident, (hd,)),
        "k_norm": _Conv(p + "self_attn.k_norm.weight", ident, ident, (hd,)),
        "o": _Conv(
            p + "self_attn.o_proj.weight",
            lambda a: a.reshape(D, H, hd).transpose(1, 2, 0),
            lambda a: a.transpose(2, 0, 1).reshape(D, H * hd),
            (D, H * hd),
        ),
        "o_bias": _Conv(p + "self_attn.o_proj.bias", ident, ident, (D,)),
        "gate": _Conv(p + "mlp.gate_proj.weight", T, T, (F, D), mlp="dense"),
        "up": _Conv(p + "mlp.up_proj.weight", T, T, (F, D), mlp="dense"),
        "down": _Conv(p + "mlp.down_proj.weight", T, T, (D, F), mlp="dense"),
    }
    if spec.is_moe:
        table.update(_moe_layout(spec, p))
    return {n: table[n] for n in param_layout(spec) if n in table}


def _moe_layout(spec: ModelSpec, p: str) -> dict[str, _Conv]:
    """A mixture of experts' tensors (layer prefix `p`): the router, one tensor per
    expert (what transformers saves and loads), Qwen2-MoE's shared expert and its gate."""
    D, E, Fe = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    Fs, x, sh = (
        spec.shared_expert_intermediate_size,
        p + "mlp.experts.{j}.",
        p + "mlp.shared_expert.",
    )
    T = lambda a: a.T  # noqa: E731
    table = {
        "router": _Conv(p + "mlp.gate.weight", T, T, (E, D)),
        "expert_gate": _Conv(x + "gate_proj.weight", T, T, (Fe, D), experts=E),
        "expert_up": _Conv(x + "up_proj.weight", T, T, (Fe, D), experts=E),
        "expert_down": _Conv(x + "down_proj.weight", T, T, (D, Fe), experts=E),
        "shared_gate": _Conv(sh + "gate_proj.weight", T, T, (Fs, D)),
        "shared_up": _Conv(sh + "up_proj.weight", T, T, (Fs, D)),
        "shared_down": _Conv(sh + "down_proj.weight", T, T, (D, Fs)),
        "shared_expert_gate": _Conv(
            p + "mlp.shared_expert_gate.weight",
            lambda a: a.reshape(D),
            lambda a: a.reshape(1, D),
            (1, D),
        ),
    }
    return {n: dataclasses.replace(c, mlp="sparse") for n, c in table.items()}


# ---- reading -----------------------------------------------------------------------------------


def open_hf_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Name -> memmap view over `model.safetensors` or a sharded `model.safetensors.index.json`."""
    out: dict[str, np.ndarray] = {}
    where: dict[str, str] = {}
    for file in hf_weight_files(path):
        tensors = open_safetensors(file)
        twice = sorted(set(tensors) & set(out))
        if twice:
            raise CheckpointError(
                f"{path}: tensor {twice[0]!r} is in both {where[twice[0]]} and {file.name}; "
                "each tensor must be stored once"
            )
        out.update(tensors)
        where.update(dict.fromkeys(tensors, file.name))
    return out


def hf_weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF directory (one, or the shards its index names)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shards that are not there: {missing}")
        return files
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"{path}: no model.safetensors or model.safetensors.index.json "
        "(PyTorch .bin checkpoints are not read; re-save with safe_serialization=True)"
    )


def check_hf_shapes(spec: ModelSpec, shapes: Mapping[str, Any], *, where: str) -> None:
    """Every tensor the spec needs is there with its shape: one message per defect, before
    any device is touched."""
    for name, c in hf_layout(spec).items():
        needed = {n: c.hf_shape for n in c.names(spec)}
        check_shapes(shapes, needed, where=where, needed_for=f" (needed for {name})")


def check_shapes(
    shapes: Mapping[str, Any], needed: Mapping[str, tuple], *, where: str, needed_for: str = ""
) -> None:
    """Each tensor `needed` (name -> shape) is in a checkpoint's `shapes` with its shape."""
    for n, shape in needed.items():
        if n not in shapes:
            raise CheckpointError(f"{where}: missing tensor {n!r}{needed_for}")
        if tuple(shapes[n]) != shape:
            raise CheckpointError(
                f"{where}: tensor {n!r} has shape {tuple(shapes[n])} in the "
                f"checkpoint but the config needs {shape}"
            )


# Weights are stored in a float dtype; any other (int, bool) is a damaged or foreign file.
_FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


def check_float_tensors(
    tensors: Mapping[str, np.ndarray], names: Iterable[str], *, where: str
) -> None:
    """Each of `names` in `tensors` has a float dtype: an int or bool weight is refused
    naming it, not cast to floats silently."""
    for n in sorted(names):
        if n in tensors and tensors[n].dtype.name not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"{where}: tensor {n!r} has dtype {tensors[n].dtype.name}; weights are one of "
                f"{list(_FLOAT_DTYPES)}"
            )


def hf_views(spec: ModelSpec, tensors: Mapping[str, np.ndarray], *, where: str) -> dict:
    """HF-named host tensors checked and viewed in our layout (`model_from_views`)."""
    conv = hf_layout(spec)
    check_hf_shapes(spec, {n: t.shape for n, t in tensors.items()}, where=where)
    used = {n for c in conv.values() for n in c.names(spec)}
    check_float_tensors(tensors, used, where=where)
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if spec.tie_embeddings:
        unused = [n for n in unused if n != "lm_head.weight"]  # tied: HF ignores it too
    if unused:
        warnings.warn(f"{where}: {len(unused)} tensors not used, e.g. {unused[:3]}", stacklevel=2)
    views: dict[str, Any] = {}
    for name, c in conv.items():
        flat = [c.to_ours(tensors[n]) for n in c.names(spec)]
        if c.experts:  # [L, E, ...] from one tensor per layer and expert
            E = c.experts
            views[name] = [flat[i * E : (i + 1) * E] for i in range(len(c.layers(spec)))]
        else:
            views[name] = flat if name in LAYER_PARAMS else flat[0]
    return views


def model_from_views(
    spec: ModelSpec, views: Mapping[str, Any], *, mesh: Mesh | None, rules_preset: str, purpose: str
) -> Transformer:
    """A model whose parameters (param dtype) each device reads its slice of from host
    views in our layout: name -> an array, or a list of them per layer (of lists per
    expert) stacked as they are read. A parameter without a view (the value head, which
    checkpoints may lack) is zeros."""
    dtype = dtype_of(spec.param_dtype)
    shardings = param_shardings(spec, mesh, get_rules(rules_preset, purpose=purpose))
    out: dict[str, jax.Array] = {}
    for name, info in param_layout(spec).items():
        if name not in views:
            out[name] = jax.device_put(np.zeros(info.shape, dtype), shardings[name])
            continue
        read = functools.partial(_read_slice, views[name], dtype=dtype)
        out[name] = jax.make_array_from_callback(info.shape, shardings[name], read)
    return build_model(spec, mesh=mesh, rules_preset=rules_preset, purpose=purpose, params=out)


def _read_slice(view, index: tuple, *, dtype) -> np.ndarray:
    """view[index] as a `dtype` array, a list's leading axis (layers, experts) stacked."""
    if isinstance(view, list):
        picked = range(len(view))[index[0]]
        return np.stack([_read_slice(view[i], index[1:], dtype=dtype) for i in picked])
    return np.asarray(view[index], dtype)


def load_hf(
    path: str | Path,
    spec: ModelSpec | None = None,
    *,
    mesh: Mesh | None = None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
) -> Transformer:
    """An HF directory's weights in a (sharded) model; `spec` defaults to its config.json."""
    if spec is None:
        fields = spec_fields_from_hf_dir(path)
        spec = spec_from_fields(ModelConfig(path=str(path)), fields, f"HF directory {Path(path)}")
    views = hf_views(spec, open_hf_tensors(path), where=str(path))
    return model_from_views(spec, views, mesh=mesh, rules_preset=rules_preset, purpose=purpose)


# ---- export ------------------------------------------------------------------------------------


def hf_tensors_from_params(spec: ModelSpec, params: Mapping[str, np.ndarray]):
    """(HF name, array) pairs in HF layouts; the value head is not exported."""
    for name, c in hf_layout(spec).items():
        if name == "lm_head" and spec.tie_embeddings:
            continue
        a = params[name]
        stacked = 2 if c.experts else 1 if name in LAYER_PARAMS else 0  # [L, E, ...], [L, ...]
        for n, w in zip(c.names(spec), a.reshape(-1, *a.shape[stacked:]), strict=True):
            yield n, np.ascontiguousarray(c.to_hf(w))


_DTYPE_NAME = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    tokenizer_from: str | Path | None = None,
    max_shard_bytes: int = 4 << 30,
    spec: ModelSpec | None = None,
) -> Path:
    """Write `model` as an HF directory transformers loads (config.json + safetensors).

    dtype: stored dtype (default the parameter dtype). tokenizer_from: a directory
    whose tokenizer files (TOKENIZER_FILES) are copied along. Files above
    `max_shard_bytes` are split with a `model.safetensors.index.json`. spec: the spec
    config.json describes (default the model's; e.g. with the token ids of its tokenizer,
    `with_token_ids`).
    """
    spec = spec or model.spec
    dtype = dtype or spec.param_dtype
    np_dtype = np.dtype(dtype_of(dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = [(n, a.astype(np_dtype)) for n, a in hf_tensors_from_params(spec, host_params(model))]
    shards: list[list[tuple[str, np.ndarray]]] = [[]]
    size = 0
    for n, a in tensors:
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((n, a))
        size += a.nbytes
    for stale in list(out.glob("model*.safetensors")) + list(
        out.glob("model.safetensors.index.json")
    ):
        stale.unlink()
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0])
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out / fname, shard)
            weight_map.update({n: fname for n, _ in shard})
        index = {
            "metadata": {"total_size": sum(a.nbytes for _, a in tensors)},
            "weight_map": weight_map,
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = hf_config_from_spec(spec, _DTYPE_NAME[dtype])
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, out)
    return out


def with_token_ids(spec: ModelSpec, tokenizer: Any) -> ModelSpec:
    """`spec` with the BOS / EOS / pad ids it lacks taken from `tokenizer` (a model built
    from a preset knows them only through the tokenizer it was trained with)."""
    if tokenizer is None:
        return spec
    bos = getattr(tokenizer, "bos_id", None)
    return dataclasses.replace(
        spec,
        bos_token_id=spec.bos_token_id if spec.bos_token_id >= 0 or bos is None else bos,
        eos_token_ids=spec.eos_token_ids or (tokenizer.eos_id,),
        pad_token_id=spec.pad_token_id if spec.pad_token_id >= 0 else tokenizer.pad_id,
    )


def read_generation_config(model_dir: str | Path | None) -> dict[str, Any]:
    """A model directory's generation_config.json ({} without one), its EOS ids checked."""
    f = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if f is None or not f.is_file():
        return {}
    cfg = read_json_object(f)
    _ids(cfg.get("eos_token_id"), "eos_token_id", str(f))
    return cfg


def write_generation_config(
    out_dir: str | Path,
    spec: ModelSpec,
    *,
    stop_ids: Sequence[int] = (),
    base: Mapping[str, Any] | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> Path:
    """generation_config.json: the special token ids of `spec`, with `stop_ids` (the
    tokens generation ends at) first among the EOS ids; the settings of `base` (a source's
    own generation config, `read_generation_config`) kept, its EOS ids too (an instruct
    model's often list more than config.json); `sampling` (GenerationConfig fields) on
    top."""
    cfg = dict(base or {})
    base_eos = _ids(cfg.get("eos_token_id"), "eos_token_id", "generation_config.json")
    eos = list(dict.fromkeys([*stop_ids, *spec.eos_token_ids, *base_eos]))
    ids = {
        "bos_token_id": spec.bos_token_id if spec.bos_token_id >= 0 else None,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": spec.pad_token_id if spec.pad_token_id >= 0 else None,
    }
    cfg.update({k: v for k, v in ids.items() if v is not None})
    cfg.update(sampling or {})
    f = Path(out_dir) / "generation_config.json"
    f.write_text(json.dumps(cfg, indent=2) + "\n")
    return f


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def copy_tokenizer_files(src: str | Path, out: str | Path) -> None:
    """The TOKENIZER_FILES of directory `src` copied into `out`, as they are."""
    src, out = Path(src), Path(out)
    for f in TOKENIZER_FILES:
        if (src / f).is_file() and (src / f).resolve() != (out / f).resolve():
            shutil.copyfile(src / f, out / f)
