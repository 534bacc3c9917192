"""`data.source=hf`: problems from a Hugging Face `datasets` dataset.

data.path is a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`
(local, or a URL such as gs://BUCKET/data/gsm8k, which `datasets` reads through fsspec),
or a hub name (`openai/gsm8k`; needs the network and, for some, a config: `name:config`).
Records are read in the layouts of local files (`data.format`: gsm8k, math, polaris,
jsonl, auto). data.hf_split picks the training split of a DatasetDict; validation is
data.hf_val_split, or data.val_size problems held out of the training split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_jax.config import paths
from rl_jax.config.data import DataConfig
from rl_jax.knobs import ConfigError


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            "data.source='hf' needs the datasets package: pip install 'rl-jax[hf]'"
        ) from e
    return datasets


def _split(obj: Any, split: str, key: str, where: str):
    datasets = _datasets()
    if isinstance(obj, datasets.Dataset):
        if key == "data.hf_split" and split == "train":
            return obj  # a lone Dataset is its own training split
        raise ConfigError(
            f"{key}={split!r}: {where} is a single Dataset, not a DatasetDict with splits"
        )
    if split not in obj:
        raise ConfigError(f"{key}={split!r} is not a split of {where}; splits: {sorted(obj)}")
    return obj[split]


def hf_records(cfg: DataConfig) -> tuple[list[dict], list[dict] | None, str]:
    """(training records, validation records or None, a description for messages)."""
    datasets = _datasets()
    path = cfg.path if paths.is_url(cfg.path) else Path(cfg.path)
    found = paths.kind(path, "data.path")
    if paths.is_url(path) and found is None:
        raise ConfigError(f"data.path={cfg.path!r} does not exist")
    if found is not None:
        if found != "dir":
            raise ConfigError(
                f"data.path={cfg.path!r} is a file; data.source='hf' reads a `save_to_disk` "
                "directory (use data.source=file for JSONL / parquet files)"
            )
        try:
            obj = datasets.load_from_disk(str(path))
        except Exception as e:  # noqa: BLE001 - datasets raises several kinds here
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"data.path={cfg.path!r}: not a datasets `save_to_disk` directory ({first})"
            ) from None
    else:
        name, _, config = cfg.path.partition(":")
        try:
            obj = datasets.load_dataset(name, config or None)
        except Exception as e:  # noqa: BLE001 - network, unknown names, missing configs
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"data.path={cfg.path!r} is neither a local directory nor a loadable hub "
                f"dataset ({first})"
            ) from None
    train = _split(obj, cfg.hf_split, "data.hf_split", cfg.path)
    val = _split(obj, cfg.hf_val_split, "data.hf_val_split", cfg.path) if cfg.hf_val_split else None
    where = f"{cfg.path} split {cfg.hf_split!r}"
    return train.to_list(), None if val is None else val.to_list(), where
