"""The per-problem pass-rate record: No-Positive-Resampling and IsoCompute's
interference diagnostic.

Pass rates come from verifier rewards (before format/overlong shaping): a sample
passes when its reward is > 0, which is "correct" on both scales (+1/-1 and 1/0).
Every group the trainer scores is recorded, trained or not (groups that DAPO's
dynamic sampling discards too). Zero-variance filtering decides on the shaped
rewards the advantages read: `rl_jax.losses.zero_variance_groups`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rl_jax.config.data import DataConfig

STATE_VERSION = 1


def pass_rates(rewards_pg: np.ndarray) -> np.ndarray:
    """[P] fraction of each group's samples that passed (reward > 0)."""
    r = np.asarray(rewards_pg)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {r.shape}")
    return (r > 0).mean(axis=1)


class Curriculum:
    """Per-problem pass-rate history and retirement for one run.

    update(ids, rewards_pg) after scoring each batch; `is_retired(id)` for the
    pipeline (No-Positive-Resampling: a problem whose latest pass rate is >=
    `data.npr_threshold` is excluded from later epochs, for good);
    `state_dict` / `load_state_dict` for checkpoints (JSON-serializable).
    """

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self._last: dict[int, float] = {}  # latest pass rate per problem
        self._seen: dict[int, int] = {}  # how many groups of it were scored
        self._retired: set[int] = set()
        self.updates = 0

    def update(self, problem_ids: Sequence[int], rewards_pg: np.ndarray) -> None:
        rates = pass_rates(rewards_pg)
        if len(problem_ids) != rates.shape[0]:
            raise ValueError(f"{len(problem_ids)} problem ids but rewards for {rates.shape[0]}")
        for pid, rate in zip(problem_ids, rates, strict=True):
            pid = int(pid)
            self._last[pid] = float(rate)
            self._seen[pid] = self._seen.get(pid, 0) + 1
            if self.cfg.no_positive_resampling and rate >= self.cfg.npr_threshold:
                self._retired.add(pid)
        self.updates += 1

    def is_retired(self, problem_id: int) -> bool:
        return int(problem_id) in self._retired

    def retired_ids(self) -> set[int]:
        return self._retired

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    def pass_rate(self, problem_id: int) -> float | None:
        return self._last.get(int(problem_id))

    # -- interference diagnostics (IsoCompute) ----------------------------------
    def pass_rate_histogram(
        self, bins: int | Sequence[float] = 10
    ) -> tuple[np.ndarray, np.ndarray]:
        """(counts, edges) of the latest training pass@1 of every problem seen so far."""
        values = np.fromiter(self._last.values(), np.float64, len(self._last))
        return np.histogram(values, bins=bins, range=(0.0, 1.0))

    def interference_metrics(self, bins: int = 10) -> dict[str, Any]:
        """One row of the interference diagnostic, for the metrics log at an eval step.

        A few problems racing to 1 while many stay at 0 ("rich get richer") shows as
        mass at both ends of the histogram; larger n gives a flatter one.
        """
        counts, edges = self.pass_rate_histogram(bins)
        values = np.fromiter(self._last.values(), np.float64, len(self._last))
        n = max(len(values), 1)
        return {
            "interference/hist": [int(c) for c in counts],
            "interference/edges": [float(e) for e in edges],
            "interference/seen": len(values),
            "interference/frac_zero": float((values == 0).sum() / n),
            "interference/frac_one": float((values == 1).sum() / n),
            "interference/mean_pass": float(values.mean()) if len(values) else 0.0,
            "interference/retired": len(self._retired),
        }

    # -- checkpointing ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "last": {str(k): v for k, v in self._last.items()},
            "seen": {str(k): v for k, v in self._seen.items()},
            "retired": sorted(self._retired),
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"curriculum state version {state.get('version')} != {STATE_VERSION}")
        self._last = {int(k): float(v) for k, v in state["last"].items()}
        self._seen = {int(k): int(v) for k, v in state["seen"].items()}
        self._retired = {int(k) for k in state["retired"]}
        self.updates = int(state["updates"])
