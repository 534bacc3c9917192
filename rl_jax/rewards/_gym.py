"""reasoning-gym scorers (optional `gym` extra), run inside a sandbox worker.

A reasoning-gym scorer needs the whole dataset entry, so a gym problem's
`answer` string is the JSON `{"dataset": name, "entry": entry}` (written by
`rl_jax.data`). The model's answer is the content of its last
`<answer>...</answer>` tag (reasoning-gym's convention), else the whole
stripped completion tail. Third-party scorers are untrusted code paths for
untrusted text, hence the worker and its time limit. Scores are in [0, 1]
(some datasets give partial credit).
"""

from __future__ import annotations

import json
import re

TAIL_CHARS = 4096
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("reasoning_gym") is not None


def encode_gym_answer(dataset: str, entry: dict) -> str:
    return json.dumps({"dataset": dataset, "entry": entry}, sort_keys=True, default=str)


def extract_gym(completion: str) -> str:
    tags = _ANSWER_TAG.findall(completion)
    return (tags[-1] if tags else completion).strip()


def gym_score(model_answer: str, answer_json: str) -> float:
    import reasoning_gym

    blob = json.loads(answer_json)
    fn = reasoning_gym.get_score_answer_fn(blob["dataset"])
    score = float(fn(model_answer, blob["entry"]))
    return min(max(score, 0.0), 1.0) if score == score else 0.0
