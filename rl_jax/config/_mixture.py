"""`data.mixture`: several prompt sources in one run, each batch drawn in stated proportions.

Two spellings of one thing:

    data.mixture=arith:1,code:1              sources by name (a task per source), weights
    data.mixture='{math: {source: file, path: gs://b/math.jsonl, weight: 1},
                   code: {source: file, path: gs://b/code.jsonl, weight: 1, reward: code}}'

A task is a name (its metrics are `val/<name>/...`), a weight (> 0; normalized), the
verifier its problems are scored with (`reward`; default its source's own), and data.*
knobs of its own (source, task, difficulty, path, format, fields...). Knobs a task does
not set are their defaults, except those shared by the run (`INHERITED`: the seed,
sizes and chat rendering) which come from the run's data.* values. How batches are
drawn and filtered (`MIXTURE_ONLY`) belongs to the mixture, not a task.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

from rl_jax.knobs import ConfigError

# Data knobs of RL's batches and curriculum: how problems are drawn and filtered, not
# what a problem is.
BATCH_KNOBS = (
    "prompts_per_batch",
    "zero_variance_filter",
    "no_positive_resampling",
    "npr_threshold",
    "dynamic_sampling",
    "max_resample_rounds",
)
# Knobs of the whole mixture (batches and curriculum), never a task's.
MIXTURE_ONLY = ("mixture", *BATCH_KNOBS)
# Knobs a task takes from the run's data.* values unless it sets them.
INHERITED = ("seed", "train_size", "val_size", "chat_template", "system_prompt")
# What a task may set besides data.* knobs.
TASK_KEYS = ("weight", "reward")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_SHORT = re.compile(
    r"\s*[A-Za-z][\w.-]*\s*(:\s*[0-9.eE+-]+)?\s*(,\s*[A-Za-z][\w.-]*\s*(:\s*[0-9.eE+-]+)?\s*)*"
)


@dataclass(frozen=True)
class MixtureTask:
    name: str
    weight: float  # normalized: the weights of a mixture sum to 1
    reward: str  # the verifier ('' = the source's own)
    settings: tuple[tuple[str, Any], ...]  # the data.* knobs it sets, sorted

    def data(self, base):
        """This task's DataConfig: defaults, the run's INHERITED knobs (of `base`, the run's
        DataConfig), its own settings."""
        inherited = {k: getattr(base, k) for k in INHERITED}
        try:
            return type(base)(**{**inherited, **dict(self.settings)})
        except ConfigError as e:
            raise ConfigError(f"data.mixture task {self.name!r}: {e}") from None


def _read(text: str) -> list[tuple[str, dict]]:
    """(name, settings) per task, in the order given."""
    if _SHORT.fullmatch(text):
        out = []
        for item in text.split(","):
            name, _, w = item.partition(":")
            try:
                weight = float(w) if w else 1.0
            except ValueError:  # digits, dots and signs that make no number: 0.5.5, e, -
                raise ConfigError(
                    f"data.mixture task {name.strip()!r}: weight {w.strip()!r} is not a number"
                ) from None
            out.append((name.strip(), {"source": name.strip(), "weight": weight}))
        return out
    import yaml

    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(
            f"data.mixture is neither 'name:weight,...' nor YAML/JSON ({first})"
        ) from None
    if isinstance(spec, dict):
        items = []
        for name, v in spec.items():
            v = {"source": name, "weight": v} if isinstance(v, int | float) else v
            items.append((name, v))
    elif isinstance(spec, list) and all(isinstance(v, dict) for v in spec):
        items = [(v.get("name"), {k: x for k, x in v.items() if k != "name"}) for v in spec]
    else:
        raise ConfigError(
            "data.mixture must be 'name:weight,...', a mapping {name: {weight, source, ...}} "
            f"or a list of {{name, weight, ...}}, got {text!r}"
        )
    for name, v in items:
        if not isinstance(v, dict):
            raise ConfigError(f"data.mixture task {name!r}: expected a mapping of knobs, got {v!r}")
    return items


def _check_value(task: str, key: str, value: Any, hint: Any) -> None:
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(getattr(hint, "__name__", str(hint)), True)
    if not ok:
        kind = getattr(hint, "__name__", hint)
        raise ConfigError(f"data.mixture task {task!r}: {key}={value!r}: expected {kind}")


def parse_mixture(
    text: str, *, data_cls: type, sources: tuple[str, ...]
) -> tuple[MixtureTask, ...]:
    """The tasks of a data.mixture value (`data_cls`: DataConfig, whose knobs a task sets;
    `sources`: its source names); ConfigError naming the task and what is wrong."""
    from rl_jax.rewards import names as reward_names

    items = _read(text)
    if not items:
        raise ConfigError("data.mixture names no task")
    hints = typing.get_type_hints(data_cls)
    fields = {f.name for f in dataclasses.fields(data_cls)}
    seen, tasks = set(), []
    for name, v in items:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ConfigError(
                f"data.mixture task name {name!r}: letters, digits, _ . - (a letter first; it "
                "names the task's metrics val/<name>/...)"
            )
        if name in seen:
            raise ConfigError(f"data.mixture names task {name!r} twice")
        seen.add(name)
        weight = v.get("weight", 1.0)
        number = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not number or not 0 < weight < math.inf:
            raise ConfigError(
                f"data.mixture task {name!r}: weight={weight!r} must be > 0 and finite"
            )
        reward = v.get("reward", "")
        # 'mixture' routes each answer to the verifier it names: a task's own is one of the rest.
        verifiers = [n for n in reward_names() if n != "mixture"]
        if reward and reward not in verifiers:
            raise ConfigError(
                f"data.mixture task {name!r}: reward={reward!r} is not one of {verifiers}"
            )
        settings = {}
        if "source" not in v:
            if name not in sources:
                raise ConfigError(
                    f"data.mixture task {name!r} names no source: set its source (one of "
                    f"{list(sources)}), or name the task after one"
                )
            settings["source"] = name
        for key, value in v.items():
            if key in TASK_KEYS:
                continue
            if key in MIXTURE_ONLY or key not in fields:
                why = (
                    "is the mixture's (set data." + key + ")"
                    if key in MIXTURE_ONLY
                    else ("is not a data knob")
                )
                raise ConfigError(f"data.mixture task {name!r}: {key!r} {why}")
            _check_value(name, key, value, hints[key])
            settings[key] = float(value) if hints[key] is float else value
        tasks.append((name, float(weight), reward, tuple(sorted(settings.items()))))
    return _normalized(tasks)


def _normalized(tasks: list[tuple]) -> tuple[MixtureTask, ...]:
    """MixtureTasks of (name, weight, reward, settings), the weights divided by their sum
    (by the largest first where they sum past the float range)."""
    total = sum(w for _, w, _, _ in tasks)
    if total == math.inf:
        top = max(w for _, w, _, _ in tasks)
        tasks = [(n, w / top, r, s) for n, w, r, s in tasks]
        total = sum(w for _, w, _, _ in tasks)
    return tuple(MixtureTask(n, w / total, r, s) for n, w, r, s in tasks)


def canonical_mixture(tasks: tuple[MixtureTask, ...]) -> str:
    """One spelling of a mixture's tasks (JSON, weights normalized): the same mixture
    written two ways is one run id."""
    return json.dumps(
        [
            {"name": t.name, "weight": t.weight, **({"reward": t.reward} if t.reward else {}),
             **dict(t.settings)}
            for t in tasks
        ],
        sort_keys=True,
    )  # fmt: skip
