"""Early decision: which partial runs can still beat the leader's asymptote?

Given each recipe's (partial) curve fit and its bootstrap distribution of A,
the probability that a recipe's asymptote beats the current leader's is
P(A_i > A_leader + margin) with the two distributions independent (separate
runs). A grid can stop a recipe once that probability falls below a threshold.

A curve that has not bent yet has a wide bootstrap distribution of A (often
reaching the metric's maximum), so its probability stays high and it is not
stopped: uncertainty protects young runs rather than condemning them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rl_jax.scaling._bootstrap import Bootstrap, bootstrap
from rl_jax.scaling._sigmoid import FitError, SigmoidFit


@dataclass(frozen=True, kw_only=True)
class EarlyRow:
    name: str
    A: float
    A_interval: tuple[float, float]
    p_beats_leader: float | None  # None for the leader itself
    p_best: float  # probability of having the highest A of all recipes
    stop: bool
    reliable: bool


@dataclass(frozen=True, kw_only=True)
class EarlyDecision:
    leader: str
    threshold: float
    margin: float
    rows: tuple[EarlyRow, ...]

    def to_dict(self) -> dict:
        return {
            "leader": self.leader,
            "threshold": self.threshold,
            "margin": self.margin,
            "rows": [r.__dict__ | {"A_interval": list(r.A_interval)} for r in self.rows],
        }


def p_greater(a: np.ndarray, b: np.ndarray, margin: float = 0.0) -> float:
    """P(a > b + margin) for independent draws from two samples; ties count one half
    (both at the metric's maximum, say)."""
    a = np.asarray(a, dtype=float)
    b = np.sort(np.asarray(b, dtype=float) + margin)
    below = np.searchsorted(b, a, side="left")
    at_or_below = np.searchsorted(b, a, side="right")
    return float(np.mean((below + at_or_below) / 2) / b.size)


def early_decision(
    recipes: Mapping[str, Bootstrap | SigmoidFit],
    *,
    threshold: float = 0.05,
    margin: float = 0.0,
    n_boot: int = 200,
    seed: int = 0,
) -> EarlyDecision:
    """Per recipe: P(its A beats the leader's A + margin), P(it has the highest A), and
    whether to stop it (probability below threshold). The leader has the highest fitted A
    among reliable fits (among all when none is reliable).

    recipes: name -> Bootstrap, or a SigmoidFit (then bootstrapped over its residuals).
    """
    if len(recipes) < 2:
        raise FitError(f"an early decision compares recipes; got {len(recipes)}")
    if not 0 < threshold < 1:
        raise FitError(f"threshold={threshold!r} must be in (0, 1)")
    boots: dict[str, Bootstrap] = {}
    for i, (name, r) in enumerate(recipes.items()):
        boots[name] = r if isinstance(r, Bootstrap) else bootstrap(r, n_boot=n_boot, seed=seed + i)
    # The leader is the best *established* asymptote: an unreliable fit (a curve that has not
    # bent, say) may report a high A that nothing supports yet.
    pool = [k for k in boots if boots[k].fit.reliable] or list(boots)
    leader = max(pool, key=lambda k: boots[k].fit.A)
    a_lead = boots[leader].samples["A"]
    rng = np.random.default_rng(seed)
    draws = 4000
    names = list(boots)
    joint = np.stack([rng.choice(boots[k].samples["A"], size=draws) for k in names])  # [R, D]
    # Ties (e.g. several at the metric's maximum) are shared out evenly.
    top = joint == joint.max(0, keepdims=True)
    p_best = (top / top.sum(0, keepdims=True)).mean(1)
    rows = []
    for k, pb in zip(names, p_best, strict=True):
        bs = boots[k]
        p = None if k == leader else p_greater(bs.samples["A"], a_lead, margin)
        rows.append(
            EarlyRow(
                name=k,
                A=bs.fit.A,
                A_interval=bs.interval("A"),
                p_beats_leader=p,
                p_best=float(pb),
                stop=p is not None and p < threshold,
                reliable=bs.fit.reliable,
            )
        )
    rows.sort(key=lambda r: -r.A)
    return EarlyDecision(leader=leader, threshold=threshold, margin=margin, rows=tuple(rows))
