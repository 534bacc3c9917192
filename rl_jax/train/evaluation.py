"""Validation metrics from per-sample rewards: mean@k, best@k, worst@k (IsoCompute)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def pass_metrics(
    correct_pk: np.ndarray,
    *,
    lengths_pk: np.ndarray | None = None,
    truncated_pk: np.ndarray | None = None,
    difficulty_p: list | None = None,
    prefix: str = "val/",
) -> dict[str, float]:
    """correct_pk: [P, k] 0/1 per sample. mean@k is pass@1 averaged over k samples.

    best@k (coverage) = fraction of prompts with at least one correct sample;
    worst@k (sharpening) = fraction with all k correct.
    """
    c = np.asarray(correct_pk, dtype=np.float64)
    if c.ndim != 2 or c.size == 0:
        raise ValueError(f"correct_pk must be a non-empty [P, k] array, got shape {c.shape}")
    out = {
        f"{prefix}pass@1": float(c.mean()),
        f"{prefix}best@k": float((c.max(axis=1) > 0).mean()),
        f"{prefix}worst@k": float((c.min(axis=1) > 0).mean()),
        f"{prefix}k": float(c.shape[1]),
    }
    if lengths_pk is not None:
        out[f"{prefix}response_len"] = float(np.mean(lengths_pk))
    if truncated_pk is not None:
        out[f"{prefix}truncation_rate"] = float(np.mean(truncated_pk))
    if difficulty_p is not None:
        groups: dict = defaultdict(list)
        for i, d in enumerate(difficulty_p):
            groups[d].append(i)
        for d, idx in sorted(groups.items(), key=lambda kv: str(kv[0])):
            out[f"{prefix}pass@1/{d}"] = float(c[idx].mean())
    return out
