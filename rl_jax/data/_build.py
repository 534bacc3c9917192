"""`build_task(cfg)`: the train/val problems a DataConfig describes, by source name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl_jax.config import paths
from rl_jax.config.data import DataConfig
from rl_jax.data._files import record_layout
from rl_jax.data._problem import MappedSequence, Problem, Task, make_problem, templated
from rl_jax.data._sources import RawSplits, raw_problems
from rl_jax.knobs import ConfigError


def _tfds_splits(cfg: DataConfig, make: Callable[[Problem], Problem]) -> RawSplits:
    from rl_jax.data._tfds import decode_record, open_tfds

    sources = open_tfds(cfg.task, cfg.path or None)
    if "train" not in sources:
        raise ConfigError(f"tfds dataset {cfg.task!r} has no 'train' split: {sorted(sources)}")
    val_key = next((k for k in ("validation", "test") if k in sources), None)

    def ours(rec) -> Problem:
        pid, question, answer, meta = decode_record(rec)
        return make(
            Problem(id=pid, prompt=question, answer=answer, meta={**meta, "question": question})
        )

    first = sources["train"][0]
    where = f"tfds dataset {cfg.task!r}"
    # Another tfds dataset's records: read as a file's would be, lazily (a row whose answer
    # cannot be read is an error when it is read; it cannot be dropped from a lazy view).
    own = {"id", "question", "answer", "meta"} <= set(first)
    layout = None if own else record_layout(_decoded(first), cfg, where)

    def foreign(rec) -> Problem:
        try:
            question, answer = layout.read(_decoded(rec))
        except ValueError as e:
            raise ConfigError(f"{where} record: {e}") from None
        if answer is None:
            raise ConfigError(f"{where}: a record has no answer to read ({layout.describe()})")
        meta = {"task": f"tfds:{cfg.task}", "question": question}
        return make(make_problem(question, answer, meta))

    fn = ours if own else foreign
    train = MappedSequence(sources["train"], fn)
    val = MappedSequence(sources[val_key], fn) if val_key else []
    reward = train[0].meta.get("reward") or (layout and layout.reward) or "numeric"
    return train, val, reward, None


def _decoded(rec) -> dict:
    return {k: v.decode("utf-8", "replace") if isinstance(v, bytes) else v for k, v in rec.items()}


def _select_split(problems: Sequence[Problem], ids: set[int]) -> Sequence[Problem]:
    if isinstance(problems, MappedSequence):
        keep = [i for i in range(len(problems)) if problems[i].id in ids]
        return MappedSequence(problems, lambda p: p, keep)
    return [p for p in problems if p.id in ids]


def _split_of_file(cfg: DataConfig, train, val, info: dict, report):
    """(train, val) kept to the problems of data.split_name in data.split_file (a
    difficulty split); records the split in `info` and the data report."""
    from rl_jax.data.splits import read_splits

    splits = read_splits(cfg.split_file)["splits"]
    if cfg.split_name not in splits:
        raise ConfigError(
            f"data.split_name={cfg.split_name!r} is not in {cfg.split_file}; "
            f"splits there: {sorted(splits)}"
        )
    ids = set(splits[cfg.split_name])
    n_train, n_val = len(train), len(val)
    train, val = _select_split(train, ids), _select_split(val, ids)
    if not len(train) or (n_val and not len(val)):
        raise ConfigError(
            f"split {cfg.split_name!r} of {cfg.split_file} holds {len(train)} of the "
            f"{n_train} training and {len(val)} of the {n_val} validation problems of this "
            "data config; estimate avg@k over task.train and task.val of the same config"
        )
    split_file = cfg.split_file if paths.is_url(cfg.split_file) else str(Path(cfg.split_file))
    info.update(split=cfg.split_name, split_file=split_file)
    if report is not None:
        report.split = f"split {cfg.split_name!r} of data.split_file"
    return train, val


def build_task(
    cfg: DataConfig,
    *,
    tokenizer: Any = None,
    verifier: str = "auto",
    chat_template: Callable[[str], str] | None = None,
) -> Task:
    """Train and validation problems of `cfg`, rendered, filtered by its difficulty split.

    tokenizer: the model's; prompts are rendered with its chat template when it ships one
        and data.chat_template is on (`rl_jax.data.prompt_renderer`). None: plain text.
    verifier: rewards.name ('auto': the data's own), for data.answer_instruction=auto.
    chat_template: instead of a tokenizer, `fn(user_text) -> prompt` applied after
        data.prompt_template.
    """
    if cfg.mixture:
        from rl_jax.data._mixture import mixture_task

        def one(task_cfg: DataConfig, reward: str) -> Task:
            # rewards.name, when set, scores every task; else the task's own verifier.
            chosen = verifier if verifier not in ("", "auto") else reward or "auto"
            return build_task(
                task_cfg, tokenizer=tokenizer, verifier=chosen, chat_template=chat_template
            )

        return mixture_task(cfg, one)
    render: list[Callable[[str], str] | None] = [chat_template]
    make = lambda p: templated(p, cfg.prompt_template, render[0])
    if cfg.source == "tfds":
        # Rendered lazily, as records are read: the renderer is set once the verifier is known.
        train, val, reward, report = _tfds_splits(cfg, make)
    else:
        train, val, reward, report = raw_problems(cfg)
    if chat_template is None:
        from rl_jax.data._chat import prompt_renderer

        chosen = reward if verifier in ("", "auto") else verifier
        render[0] = prompt_renderer(cfg, tokenizer, verifier=chosen)
    if cfg.source != "tfds":
        train, val = [make(p) for p in train], [make(p) for p in val]
    info = {"source": cfg.source, "task": cfg.task, "difficulty": cfg.difficulty}
    if cfg.split_file:
        train, val = _split_of_file(cfg, train, val, info, report)
    info.update(train_size=len(train), val_size=len(val))
    if report is not None:
        report.train, report.val = len(train), len(val)
    own = ("countdown", "code", "file", "hf")
    name = cfg.source if cfg.source in own else f"{cfg.source}:{cfg.task}"
    return Task(name=name, train=train, val=val, reward_name=reward, info=info, report=report)
