"""tensorflow-datasets builder (optional `tfds` extra): problems -> ArrayRecord -> grain.

`prepare_tfds(cfg, data_dir)` turns what a DataConfig describes (a local file or
a built-in task) into an ArrayRecord dataset `rl_jax_prompts/<config>` with
`train` and `validation` splits; `source=tfds` reads it back through
`tfds.data_source` (random access, no TensorFlow needed) as lazy Problems that
grain indexes directly. Records keep the untemplated question, so the prompt
template is applied at read time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from rl_jax.config.data import DataConfig
from rl_jax.data._sources import raw_problems
from rl_jax.knobs import ConfigError

try:
    import tensorflow_datasets as tfds
except ImportError:  # the optional extra is absent; prepare/read say so when called
    tfds = None

BUILDER = "rl_jax_prompts"
# Fields that decide which problems a config yields (not how they are batched or filtered).
_CONTENT_FIELDS = (
    "source", "task", "difficulty", "num_terms", "path", "val_path", "format",
    "gym_kwargs", "train_size", "val_size", "seed", "reverse_digits",
)  # fmt: skip
# Fields that decide which problems too, added later: in a dataset's name only when set, so
# the names of datasets prepared before them stay as they were.
_LATER_CONTENT_FIELDS = {
    "question_field": "", "answer_field": "", "answer_extract": "auto", "answer_regex": "",
}  # fmt: skip


def _require_tfds():
    if tfds is None:
        raise ConfigError(
            "source=tfds needs tensorflow-datasets and array-record: pip install 'rl-jax[tfds]'"
        )
    return tfds


if tfds is not None:

    @dataclasses.dataclass(eq=False)
    class PromptsConfig(tfds.core.BuilderConfig):
        """The DataConfig (as a dict) whose problems this dataset holds."""

        data: dict[str, Any] = dataclasses.field(default_factory=dict)

    class RlJaxPrompts(tfds.core.GeneratorBasedBuilder):
        """Prompt problems of an rl_jax DataConfig (see rl_jax.data.prepare_tfds)."""

        VERSION = tfds.core.Version("1.0.0")
        BUILDER_CONFIGS: list = []

        # No checksums file to find next to this module (nothing is downloaded); tfds's own
        # lookup also needs `importlib_resources`, which tensorflow-datasets does not install.
        @tfds.core.utils.classproperty
        @classmethod
        def code_path(cls):
            return None

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                description="rl_jax prompt problems: id, untemplated question, answer, meta",
                features=tfds.features.FeaturesDict(
                    {
                        "id": np.int64,
                        "question": tfds.features.Text(),
                        "answer": tfds.features.Text(),
                        "meta": tfds.features.Text(),  # JSON object
                    }
                ),
            )

        def _split_generators(self, dl_manager):
            cfg = DataConfig(**self.builder_config.data)
            train, val, _, _ = raw_problems(cfg)
            splits = {"train": self._generate_examples(train)}
            if val:
                splits["validation"] = self._generate_examples(val)
            return splits

        def _generate_examples(self, problems):
            for p in problems:
                meta = {k: v for k, v in p.meta.items() if k != "question"}
                yield (
                    p.id,
                    {
                        "id": p.id,
                        "question": p.meta["question"],
                        "answer": p.answer,
                        "meta": json.dumps(meta, sort_keys=True, default=str),
                    },
                )


def _content(cfg: DataConfig) -> dict[str, Any]:
    """The fields that decide a config's problems, its files as absolute paths."""
    content = {k: getattr(cfg, k) for k in _CONTENT_FIELDS}
    content.update(
        {k: getattr(cfg, k) for k, d in _LATER_CONTENT_FIELDS.items() if getattr(cfg, k) != d}
    )
    for k in ("path", "val_path"):
        if content[k]:
            content[k] = str(Path(content[k]).resolve())
    return content


def config_name(cfg: DataConfig) -> str:
    content = _content(cfg)
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:12]
    return f"{cfg.source}_{digest}"


def prepare_tfds(cfg: DataConfig, data_dir: str | Path) -> str:
    """Write `cfg`'s problems (file or built-in task source) as ArrayRecord under data_dir.

    Returns the dataset name; read it back with `data.source=tfds data.task=<name>
    data.path=<data_dir>`. Idempotent: an existing dataset is reused.
    """
    _require_tfds()
    if cfg.source == "tfds":
        raise ConfigError("prepare_tfds needs a file or built-in source, not data.source='tfds'")
    data = _content(cfg)
    name = config_name(cfg)
    builder = RlJaxPrompts(
        config=PromptsConfig(name=name, description=f"rl_jax {cfg.source} prompts", data=data),
        data_dir=str(data_dir),
        file_format="array_record",
    )
    builder.download_and_prepare()
    return f"{BUILDER}/{name}"


def open_tfds(name: str, data_dir: str | Path | None) -> dict[str, Any]:
    """Random-access ArrayRecord sources by split (`train`, `validation`, ...)."""
    _require_tfds()
    root = Path(data_dir).expanduser() if data_dir else None
    # Our own datasets carry their config in their files: read them from the directory
    # so the config need not be registered in this process.
    if root is not None and name.startswith(BUILDER + "/"):
        base = root / name
        versions = sorted(p for p in base.glob("*") if (p / "dataset_info.json").exists())
        if not versions:
            raise ConfigError(f"no prepared dataset {name!r} under {root}; run prepare_tfds first")
        return dict(tfds.builder_from_directory(str(versions[-1])).as_data_source())
    try:
        return dict(tfds.data_source(name, data_dir=str(root) if root else None, download=False))
    except Exception as e:
        raise ConfigError(f"cannot open tfds dataset {name!r} in {root}: {e}") from e


def decode_record(rec: dict[str, Any]) -> tuple[int, str, str, dict[str, Any]]:
    """(id, question, answer, meta) of one of our records; str fields arrive as bytes."""

    def text(x):
        return x.decode("utf-8") if isinstance(x, bytes) else str(x)

    return int(rec["id"]), text(rec["question"]), text(rec["answer"]), json.loads(text(rec["meta"]))
