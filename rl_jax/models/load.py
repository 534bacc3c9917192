"""A model from a ModelConfig or a path: its spec, then its weights, by format.

`model.path` picks the format: a `.gguf` file (rl_jax.models.gguf_io), an rl_jax
model directory (rl_jax.models.native) or else an HF directory (rl_jax.models.hf).
Without a path the spec is `model.preset`'s (or the explicit fields) and the
weights a random init. `model.path` may be a URL (gs://...): it is copied into a local
cache first (`local_model_path`). The format modules are imported when a path needs them:
they import JAX, and a preset's spec needs none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_jax.config import paths
from rl_jax.config.model import ModelConfig
from rl_jax.knobs import ConfigError
from rl_jax.models.spec import ModelSpec, get_preset, spec_from_fields

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from rl_jax.models.transformer import Transformer

# What a model directory's spec and tokenizer are read from (config.json, tokenizer.json,
# tokenizer_config.json, chat_template.jinja, ...): a remote model's spec resolves without
# copying its weights.
METADATA_FILES = ("*.json", "*.jinja")


def local_model_path(path: str | Path, *, weights: bool = True) -> Path:
    """`model.path` on this machine: a local path as given; a URL (gs://BUCKET/models/NAME,
    any fsspec protocol) copied once into the local input cache (rl_jax.config.paths.stage),
    where the loaders memory-map it. Without `weights`, a remote directory's copy holds its
    JSON and template files only: enough for the spec and the tokenizer."""
    return paths.stage(path, "model.path", files=() if weights else METADATA_FILES)


def base_fields(cfg: ModelConfig) -> tuple[dict[str, Any], str]:
    """Architecture fields before overrides, and where they came from."""
    if cfg.path:
        p = local_model_path(cfg.path, weights=False)
        kind, read_fields, _ = _format(p)
        return read_fields(p), f"{kind} {cfg.path if paths.is_url(cfg.path) else p}"
    if cfg.preset:
        return get_preset(cfg.preset), f"preset {cfg.preset!r}"
    return {}, "explicit fields (model.preset='')"


def resolve_spec(cfg: ModelConfig) -> ModelSpec:
    """Every dimension resolved: `cfg.path` else `cfg.preset`, then explicit fields override.
    A checkpoint's fields that make no valid spec (vocab_size -64, num_heads not dividing
    hidden_size) are a ConfigError naming the checkpoint, not only the model.* field."""
    fields, source = base_fields(cfg)
    try:
        return spec_from_fields(cfg, fields, source)
    except ConfigError as e:
        if not cfg.path or source in str(e):
            raise
        raise ConfigError(f"{source}: {e}") from None


def load_model(
    source: str | Path | ModelConfig,
    *,
    mesh: Mesh | None = None,
    rules_preset: str = "fsdp_tp",
    purpose: str = "train",
    seed: int = 0,
) -> Transformer:
    """A model from a ModelConfig (random init unless `path`) or a path: an HF directory,
    a GGUF file or an rl_jax model directory (`save_model`)."""
    cfg = source if isinstance(source, ModelConfig) else ModelConfig(path=str(source))
    spec = resolve_spec(cfg)
    kw = dict(mesh=mesh, rules_preset=rules_preset, purpose=purpose)
    if not cfg.path:
        from rl_jax.models.transformer import build_model

        return build_model(spec, seed=seed, **kw)
    path = local_model_path(cfg.path)
    return _format(path)[2](path, spec, **kw)


def _format(path: Path) -> tuple[str, Callable, Callable]:
    """What `path` holds, by its format: (its name, the reader of its spec's fields, its
    loader), from the format's module."""
    if path.suffix == ".gguf":
        from rl_jax.models import gguf_io

        return "GGUF file", gguf_io.spec_fields_from_gguf, gguf_io.load_gguf
    from rl_jax.models import native

    if native.is_native_dir(path):
        return "rl_jax model directory", native.spec_fields_from_native, native.load_native
    from rl_jax.models import hf

    return "HF directory", hf.spec_fields_from_hf_dir, hf.load_hf
