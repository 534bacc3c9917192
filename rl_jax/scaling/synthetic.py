"""Synthetic curves drawn from known sigmoid parameters, as curve rows or arrays.

For tests, demos and for checking a fitting setup before spending compute: the
truth is known, so recovery errors and interval coverage can be measured.
Evaluations are evenly spaced in compute (a trainer evaluates every k steps),
starting with one at compute 0 (the base model, R0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rl_jax.scaling._sigmoid import sigmoid


def synthetic_curve(
    rng: np.random.Generator,
    *,
    r0: float,
    a: float,
    b: float,
    c_mid: float,
    c_max: float,
    n_points: int = 40,
    noise: float = 0.01,
    clip: tuple[float, float] = (0.0, 1.0),
) -> tuple[np.ndarray, np.ndarray]:
    """x: n_points + 1 evaluations at 0, c_max / n_points, ..., c_max; y: R(x) + N(0, noise^2)."""
    x = np.linspace(0.0, c_max, n_points + 1)
    y = sigmoid(x, r0=r0, a=a, b=b, c_mid=c_mid) + rng.normal(0.0, noise, x.size)
    return x, np.clip(y, *clip)


def draw_params(rng: np.random.Generator, *, c_mid_range=(1e13, 1e15), reach=(10.0, 30.0)):
    """Parameters over the ScaleRL paper's ranges: A in [0.45, 0.8], B in [1, 3], R0 in
    [0.15, 0.35], and runs lasting `reach` x C_mid (the paper's runs: about 6x to 25x)."""
    c_mid = float(10 ** rng.uniform(*np.log10(c_mid_range)))
    return {
        "r0": float(rng.uniform(0.15, 0.35)),
        "a": float(rng.uniform(0.45, 0.8)),
        "b": float(rng.uniform(1.0, 3.0)),
        "c_mid": c_mid,
        "c_max": c_mid * float(rng.uniform(*reach)),
    }


def curve_rows(
    run_id: str,
    x: Sequence[float],
    y: Sequence[float],
    *,
    recipe: str = "",
    knobs: dict[str, Any] | None = None,
    x_key: str = "flops",
    metric: str = "val/pass@1",
    steps_per_point: int = 10,
) -> list[dict[str, Any]]:
    """Curve rows in the trainer's format (DESIGN.md) for one run."""
    return [
        {
            "run_id": run_id,
            "recipe": recipe,
            "step": i * steps_per_point,
            x_key: float(xi),
            metric: float(yi),
            **(knobs or {}),
        }
        for i, (xi, yi) in enumerate(zip(x, y, strict=True))
    ]


def isocompute_rows(
    rng: np.random.Generator,
    cells: dict[tuple[int, int], dict[str, float]],
    *,
    c_max: float,
    n_points: int = 12,
    noise: float = 0.004,
    tokens_per_rollout: float = 0.0,
    metric: str = "val/pass@1",
) -> list[dict[str, Any]]:
    """Curve rows of an iso-compute grid: one run per (n, B_p) cell with known sigmoid
    parameters (r0, a, b, c_mid), each of M = c_max // (B_p * n) steps evaluated n_points
    times after step 0, as a grid's curves.jsonl holds them (run_id = group = n<n>_bp<B_p>,
    rollouts = step * B_p * n). tokens_per_rollout > 0 adds a generated_tokens column."""
    rows = []
    for (n, bp), params in cells.items():
        steps = np.unique(np.round(np.linspace(0, c_max // (n * bp), n_points + 1)).astype(int))
        x = steps * float(n * bp)
        y = np.clip(sigmoid(x, **params) + rng.normal(0.0, noise, x.size), 0.0, 1.0)
        name = f"n{n}_bp{bp}"
        for r, step in zip(
            curve_rows(
                name,
                x,
                y,
                recipe=name,
                knobs={"sampling.n": n, "data.prompts_per_batch": bp, "group": name},
                x_key="rollouts",
                metric=metric,
            ),
            steps,
            strict=True,
        ):
            r["step"], r["status"] = int(step), "done"
            if tokens_per_rollout:
                r["generated_tokens"] = r["rollouts"] * tokens_per_rollout
            rows.append(r)
    return rows
