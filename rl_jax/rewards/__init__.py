"""Verifiers by name, safe on hostile model output and bounded in time.

    fn = rl_jax.rewards.get("arith", scale="pm1")
    fn("64", "64")                              # 1.0
    rl_jax.rewards.score_batch(fn, completions, answers)   # np.ndarray [N]

Names: arith, countdown, numeric (pure Python, bounded by construction);
math (math-verify, `math` extra) and gym (reasoning-gym, `gym` extra) run in
sandbox worker processes with a per-call time limit; code runs a completion's program
against its problem's tests (the answer: JSON, rl_jax.rewards._code) in a fresh
process behind kernel limits, from those workers (docs/code.md).
"""

from rl_jax.rewards._countdown import (
    evaluate_expression,
    format_countdown_answer,
    parse_countdown_answer,
)
from rl_jax.rewards._gym import encode_gym_answer
from rl_jax.rewards._numeric import last_boxed, parse_number
from rl_jax.rewards._registry import (
    SCALES,
    TaskAnswer,
    from_config,
    get,
    names,
    options,
    overlong_penalty,
    register,
    score_batch,
    shape_rewards,
)
from rl_jax.rewards._sandbox import SandboxPool

__all__ = [
    "SCALES",
    "SandboxPool",
    "TaskAnswer",
    "encode_gym_answer",
    "evaluate_expression",
    "format_countdown_answer",
    "from_config",
    "get",
    "last_boxed",
    "names",
    "options",
    "overlong_penalty",
    "parse_countdown_answer",
    "parse_number",
    "register",
    "score_batch",
    "shape_rewards",
]
