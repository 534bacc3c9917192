"""rl_jax's own model directory: `rl_jax_model.json` (the spec) + `params.safetensors`.

Parameters are stored under our names and layouts (stacked layers, value head
included), so saving and loading are lossless; `rl-jax convert` moves between
this and HF directories. Tokenizer files, if any, sit beside them as in an HF
directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from rl_jax.knobs import ConfigError
from rl_jax.models.hf import (
    CheckpointError,
    check_float_tensors,
    check_shapes,
    copy_tokenizer_files,
    model_from_views,
    read_json_object,
)
from rl_jax.models.safetensors_io import open_safetensors, write_safetensors
from rl_jax.models.spec import ModelSpec, RopeScaling
from rl_jax.models.transformer import Transformer, host_params, param_layout

SPEC_FILE = "rl_jax_model.json"
PARAMS_FILE = "params.safetensors"
FORMAT = "rl_jax.model/1"
# Precision and execution switches belong to the run, not to the weights.
_RUN_FIELDS = (
    "param_dtype",
    "compute_dtype",
    "fp32_lm_head",
    "exact_rounding",
    "remat",
    "attention",
    "attention_block",
    "scan_layers",
    "value_head",
    "logprob_chunk",
)


def is_native_dir(path: str | Path) -> bool:
    return (Path(path) / SPEC_FILE).is_file()


def spec_fields_from_native(path: str | Path) -> dict[str, Any]:
    data = read_json_object(Path(path) / SPEC_FILE)
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}/{SPEC_FILE}: format {data.get('format')!r}, need {FORMAT!r}")
    if not isinstance(data.get("spec"), dict):
        raise CheckpointError(f"{path}/{SPEC_FILE}: 'spec' must be an object")
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = sorted(set(data["spec"]) - known)
    if unknown:
        raise CheckpointError(f"{path}/{SPEC_FILE}: unknown spec fields {unknown}")
    fields = {k: v for k, v in data["spec"].items() if k not in _RUN_FIELDS}
    _check_types(fields, where=f"{path}/{SPEC_FILE}")
    if fields.get("rope_scaling"):
        try:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        except (TypeError, ConfigError) as e:
            raise CheckpointError(f"{path}/{SPEC_FILE}: rope_scaling: {e}") from None
    for name in ("eos_token_ids", "dense_layers"):  # JSON lists
        fields[name] = tuple(fields.get(name, ()))
    return fields


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# A spec field's JSON type, by its annotation: what a value must be, and how it is named.
_JSON_TYPES = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float) and math.isfinite(v), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "tuple[int, ...]": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of ints"),
    "RopeScaling | None": (lambda v: isinstance(v, dict | None), "an object or null"),
}


def _check_types(fields: dict[str, Any], *, where: str) -> None:
    """Each spec field of the JSON type its annotation needs (an integer not a string, a
    list of ids not one id): else a CheckpointError naming the file and field."""
    types = {f.name: f.type for f in dataclasses.fields(ModelSpec)}
    for name, value in fields.items():
        ok, what = _JSON_TYPES[types[name]]
        if not ok(value):
            raise CheckpointError(f"{where}: spec field {name}={value!r} must be {what}")


def save_model(
    model: Transformer, out_dir: str | Path, *, tokenizer_from: str | Path | None = None
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = dataclasses.asdict(model.spec)
    write_safetensors(out / PARAMS_FILE, sorted(host_params(model).items()))
    (out / SPEC_FILE).write_text(json.dumps({"format": FORMAT, "spec": spec}, indent=2) + "\n")
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, out)
    return out


def load_native(
    path: str | Path,
    spec: ModelSpec,
    *,
    mesh: Mesh | None = None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
) -> Transformer:
    """Each device reads its slice of each parameter from the memory-mapped file."""
    stored = open_safetensors(Path(path) / PARAMS_FILE)
    # A policy without a critic yet has no value head: zeros (`model_from_views`).
    lay = param_layout(spec)
    needed = {n: i.shape for n, i in lay.items() if n in stored or n not in ("value_w", "value_b")}
    check_shapes({n: a.shape for n, a in stored.items()}, needed, where=f"{path}/{PARAMS_FILE}")
    check_float_tensors(stored, needed, where=f"{path}/{PARAMS_FILE}")
    return model_from_views(spec, stored, mesh=mesh, rules_preset=rules_preset, purpose=purpose)
