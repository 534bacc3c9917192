"""Prompt data: tasks, grain pipelines, curriculum filters, difficulty splits.

task = build_task(cfg.data, tokenizer=tok)         # task.train, task.val, task.reward_name
cur = Curriculum(cfg.data)
pipe = PromptPipeline(task.train, batch_size=cfg.data.prompts_per_batch,
                      seed=cfg.data.seed, curriculum=cur)
problems = next(pipe)                              # list[Problem]
... cur.update([p.id for p in problems], rewards_pg)  # pass rates, No-Positive-Resampling
checkpoint: pipe.get_state(), cur.state_dict()     # JSON-serializable
"""

from rl_jax.data._build import build_task
from rl_jax.data._chat import (
    ANSWER_INSTRUCTIONS,
    answer_instruction,
    messages,
    prompt_renderer,
    uses_chat_template,
)
from rl_jax.data._problem import LoadReport, Problem, Task
from rl_jax.data._sources import hold_out
from rl_jax.data._synthetic import arith_answer
from rl_jax.data.curriculum import Curriculum, pass_rates
from rl_jax.data.pipeline import DataExhausted, PromptPipeline, shard_problems
from rl_jax.data.splits import estimate_avg_at_k, read_splits, write_splits
from rl_jax.data.tokenizer import CharTokenizer


def prepare_tfds(cfg, data_dir):
    """Write cfg's problems as an ArrayRecord tfds dataset (needs the `tfds` extra); returns
    its name for `data.source=tfds data.task=<name> data.path=<data_dir>`."""
    from rl_jax.data._tfds import prepare_tfds as _prepare

    return _prepare(cfg, data_dir)


__all__ = [
    "ANSWER_INSTRUCTIONS",
    "answer_instruction",
    "hold_out",
    "messages",
    "prompt_renderer",
    "uses_chat_template",
    "CharTokenizer",
    "Curriculum",
    "DataExhausted",
    "LoadReport",
    "Problem",
    "PromptPipeline",
    "Task",
    "arith_answer",
    "build_task",
    "estimate_avg_at_k",
    "pass_rates",
    "prepare_tfds",
    "read_splits",
    "shard_problems",
    "write_splits",
]
