"""Logical-axis -> mesh-axis rule tables.

Models annotate arrays with *logical* axis names only; this module is the one
place that knows the mesh axis names (`data`, `fsdp`, `tensor`).

Logical axes used across rl_jax:
  batch     rows of a batch (B)            seq       time (T)
  embed     model width (D)                mlp       MLP width (F)
  heads     query heads (H)                kv_heads  key/value heads (K)
  head_dim  per-head width                 vocab     vocabulary (V)
  layers    stacked layers (L, scan)       cache_seq KV-cache time
  expert    a mixture of experts' E
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Training: batch over data+fsdp; parameters' `embed` dim sharded over fsdp
# (ZeRO-3 style), heads/mlp/vocab over tensor. A mixture of experts' weights are
# sharded over fsdp by expert (before `embed`, which then keeps whole rows): a layer
# gathers them as it gathers a dense MLP's.
TRAIN_RULES: dict[str, Rules] = {
    "dp": (("batch", BATCH_AXES),),
    "fsdp": (("batch", BATCH_AXES), ("expert", "fsdp"), ("embed", "fsdp")),
    "fsdp_tp": (
        ("batch", BATCH_AXES),
        ("expert", "fsdp"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
    ),
}

# Sampling: decode steps are latency bound, so parameters are not FSDP-sharded
# (that would all-gather every weight every token); tensor parallelism stays. A mixture
# of experts' experts stay over fsdp: the decode step moves tokens to them
# (`rl_jax.models.moe.expert_parallel_moe_mlp`), not them to the tokens.
SAMPLE_RULES: dict[str, Rules] = {
    "dp": (("batch", BATCH_AXES),),
    "fsdp": (("batch", BATCH_AXES), ("expert", "fsdp")),
    "fsdp_tp": (
        ("batch", BATCH_AXES),
        ("expert", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("vocab", "tensor"),
    ),
}


def get_rules(preset: str, *, purpose: str = "train") -> Rules:
    tables = {"train": TRAIN_RULES, "sample": SAMPLE_RULES}
    if purpose not in tables:
        raise ValueError(f"purpose={purpose!r} is not one of {sorted(tables)}")
    table = tables[purpose]
    if preset not in table:
        raise ValueError(f"mesh.rules={preset!r} is not one of {sorted(table)}")
    return table[preset]


def logical_to_spec(logical: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    lookup = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical:
        target = lookup.get(name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        axes = (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide their dimension (tiny models, odd vocab sizes)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        if axes is None:
            out.append(None)
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = []
        size = 1
        for a in names:
            if dim % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*out)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over the data axes, everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def num_batch_shards(mesh: Mesh) -> int:
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


__all__ = [
    "BATCH_AXES",
    "MESH_AXES",
    "SAMPLE_RULES",
    "TRAIN_RULES",
    "batch_sharding",
    "fit_spec",
    "get_rules",
    "logical_to_spec",
    "num_batch_shards",
    "replicated",
]
