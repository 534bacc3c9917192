"""reasoning-gym (optional `gym` extra) as a source of procedurally generated task families.

`data.task` names the dataset (e.g. `basic_arithmetic`), `data.gym_kwargs` is a
JSON object of its options (difficulty knobs differ per family), `data.seed`
seeds it. Generation is offline. Each problem's answer carries the whole entry
(`rl_jax.rewards.encode_gym_answer`) because reasoning-gym scorers need it.
"""

from __future__ import annotations

import json

from rl_jax.config.data import DataConfig
from rl_jax.data._problem import Problem, problem_id
from rl_jax.knobs import ConfigError
from rl_jax.rewards import encode_gym_answer


def gym_problems(cfg: DataConfig) -> tuple[list[Problem], list[Problem]]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError(
            "data.source='reasoning_gym' needs reasoning-gym: pip install 'rl-jax[gym]'"
        ) from e
    try:
        kwargs = json.loads(cfg.gym_kwargs) if cfg.gym_kwargs else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"data.gym_kwargs={cfg.gym_kwargs!r} is not JSON ({e})") from e
    if not isinstance(kwargs, dict):
        raise ConfigError(f"data.gym_kwargs={cfg.gym_kwargs!r} must be a JSON object")
    need = cfg.generated_val_size + cfg.train_size
    try:
        # Over-generate a little: duplicates are dropped so the splits stay disjoint.
        ds = reasoning_gym.create_dataset(
            cfg.task, size=need + need // 4 + 8, seed=cfg.seed, **kwargs
        )
    except Exception as e:  # unknown dataset names, bad options
        raise ConfigError(f"reasoning-gym dataset {cfg.task!r}: {e}") from e
    found: dict[int, Problem] = {}
    for i in range(len(ds)):
        if len(found) == need:
            break
        entry = ds[i]
        question = str(entry["question"])
        answer = encode_gym_answer(cfg.task, entry)
        pid = problem_id(f"gym:{cfg.task}", question, "")
        meta = {"task": f"gym:{cfg.task}", "question": question, "reward": "gym"}
        found.setdefault(pid, Problem(id=pid, prompt=question, answer=answer, meta=meta))
    out = list(found.values())
    if len(out) < need:
        raise ConfigError(
            f"reasoning-gym {cfg.task!r} gave only {len(out)} distinct questions, fewer than "
            f"data.val_size + data.train_size = {need}"
        )
    return out[cfg.generated_val_size :], out[: cfg.generated_val_size]
