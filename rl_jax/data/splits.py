"""Difficulty splits as IsoCompute defines them: bands of each problem's avg@k under a policy.

    avg = estimate_avg_at_k(task.train + task.val, policy, k=16)
    write_splits("splits.json", avg, k=16)
    # then: data.split_file=splits.json data.split_name=easy

The policy is any callable `policy(problems, k) -> array [P, k]` of verifier
rewards or 0/1 correctness for k sampled completions per problem (a sample
passes when > 0); the sampler plugs in here, a fake policy in tests. Bands are
closed intervals unless marked open; defaults: hard [0, 0.0625], easy
[0.3, 0.6] (IsoCompute, avg@16), and the gaps between as medium and trivial.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.config import paths
from rl_jax.data._problem import Problem
from rl_jax.knobs import ConfigError
from rl_jax.runs.atomic import atomic_write_json

FORMAT = "rl_jax.difficulty_splits"
VERSION = 1

Policy = Callable[[Sequence[Problem], int], Any]


@dataclass(frozen=True, kw_only=True)
class Band:
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, x: float) -> bool:
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below

    def to_json(self) -> list:
        return [self.lo, self.hi, self.lo_open, self.hi_open]


DEFAULT_BANDS: dict[str, Band] = {
    "hard": Band(lo=0.0, hi=0.0625),
    "medium": Band(lo=0.0625, hi=0.3, lo_open=True, hi_open=True),
    "easy": Band(lo=0.3, hi=0.6),
    "trivial": Band(lo=0.6, hi=1.0, lo_open=True),
}


def estimate_avg_at_k(
    problems: Sequence[Problem], policy: Policy, *, k: int = 16, batch_size: int = 64
) -> dict[int, float]:
    """avg@k per problem id: the mean pass of k samples, queried in batches of problems."""
    if k < 1 or batch_size < 1:
        raise ValueError(f"need k >= 1 and batch_size >= 1, got {k}, {batch_size}")
    out: dict[int, float] = {}
    for start in range(0, len(problems), batch_size):
        chunk = [problems[i] for i in range(start, min(start + batch_size, len(problems)))]
        r = np.asarray(policy(chunk, k), np.float64)
        if r.shape != (len(chunk), k):
            raise ValueError(f"policy returned shape {r.shape}, expected {(len(chunk), k)}")
        for p, rate in zip(chunk, (r > 0).mean(axis=1), strict=True):
            out[int(p.id)] = float(rate)
    return out


def assign_splits(
    avg_at_k: Mapping[int, float], bands: Mapping[str, Band] = DEFAULT_BANDS
) -> dict[str, list[int]]:
    """Problem ids per band (sorted); a problem lands in every band containing its avg@k."""
    return {
        name: sorted(int(pid) for pid, v in avg_at_k.items() if band.contains(v))
        for name, band in bands.items()
    }


def write_splits(
    path: str | Path,
    avg_at_k: Mapping[int, float],
    *,
    k: int,
    bands: Mapping[str, Band] = DEFAULT_BANDS,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write avg@k and the band splits to a JSON file (atomically); returns its content."""
    content = {
        "format": FORMAT,
        "version": VERSION,
        "k": k,
        "bands": {name: b.to_json() for name, b in bands.items()},
        "avg_at_k": {str(pid): float(v) for pid, v in sorted(avg_at_k.items())},
        "splits": assign_splits(avg_at_k, bands),
        "info": dict(info or {}),
    }
    atomic_write_json(path, content)
    return content


def read_splits(path: str | Path) -> dict[str, Any]:
    """A split file written by `write_splits`: a local path or a URL (rl_jax.config.paths)."""
    import json

    path = path if paths.is_url(path) else Path(path)
    if paths.kind(path, "data.split_file") != "file":
        raise ConfigError(f"data.split_file={str(path)!r} is not a file")
    try:
        content = json.loads(paths.read_text(path, "data.split_file"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"data.split_file={str(path)!r}: not valid JSON ({e})") from None
    if not isinstance(content, dict):
        content = {}
    splits = content.get("splits")
    ok_splits = isinstance(splits, dict) and all(
        isinstance(ids, list) and all(type(i) is int for i in ids) for ids in splits.values()
    )
    if content.get("format") != FORMAT or content.get("version") != VERSION or not ok_splits:
        raise ConfigError(
            f"{path} is not a difficulty split file (format {FORMAT!r} v{VERSION}); "
            "write one with rl_jax.data.splits.write_splits"
        )
    return content
