"""A model from a ModelConfig or a path: its spec, then its weights, by format.

`model.path` picks the format: a `.gguf` file (rl_jax.models.gguf_io), an rl_jax
model directory (rl_jax.models.native) or else an HF directory (rl_jax.models.hf).
Without a path the spec is `model.preset`'s (or the explicit fields) and the
weights a random init. The format modules are imported when a path needs them:
they import JAX, and a preset's spec needs none of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_jax.config.model import ModelConfig
from rl_jax.models.spec import ModelSpec, get_preset, spec_from_fields

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from rl_jax.models.transformer import Transformer


def base_fields(cfg: ModelConfig) -> tuple[dict[str, Any], str]:
    """Architecture fields before overrides, and where they came from."""
    if cfg.path:
        p = Path(cfg.path)
        if p.suffix == ".gguf":
            from rl_jax.models.gguf_io import spec_fields_from_gguf

            return spec_fields_from_gguf(p), f"GGUF file {p}"
        from rl_jax.models.native import is_native_dir, spec_fields_from_native

        if is_native_dir(p):
            return spec_fields_from_native(p), f"rl_jax model directory {p}"
        from rl_jax.models.hf import spec_fields_from_hf_dir

        return spec_fields_from_hf_dir(p), f"HF directory {p}"
    if cfg.preset:
        return get_preset(cfg.preset), f"preset {cfg.preset!r}"
    return {}, "explicit fields (model.preset='')"


def resolve_spec(cfg: ModelConfig) -> ModelSpec:
    """Every dimension resolved: `cfg.path` else `cfg.preset`, then explicit fields override."""
    return spec_from_fields(cfg, *base_fields(cfg))


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
    if Path(cfg.path).suffix == ".gguf":
        from rl_jax.models.gguf_io import load_gguf

        return load_gguf(cfg.path, spec, **kw)
    from rl_jax.models.native import is_native_dir, load_native

    if is_native_dir(cfg.path):
        return load_native(cfg.path, spec, **kw)
    from rl_jax.models.hf import load_hf

    return load_hf(cfg.path, spec, **kw)
