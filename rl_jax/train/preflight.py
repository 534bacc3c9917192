"""Checks of every file a run reads, before JAX starts and before any weight is loaded.

The trainer reads the model, tokenizer and data only after it has started JAX and
built its mesh; a damaged or missing file found there costs a device start and
surfaces as a traceback. These checks read headers and small JSON files only, so
the CLI runs them first and a bad input is one ConfigError line (exit 2).
"""

from __future__ import annotations

from pathlib import Path

from rl_jax.config import DataConfig, ModelConfig, RewardConfig, RunConfig
from rl_jax.knobs import ConfigError


def check_run_inputs(cfg: RunConfig) -> None:
    """Model files, data files and the verifier of `cfg`, as the trainer will read them."""
    check_model_files(cfg.model)
    task_reward = check_data_files(cfg.data)
    check_reward(cfg.rewards, task_reward=task_reward)


def check_model_files(cfg: ModelConfig, *, tokenizer: bool = True) -> None:
    """`model.path` exists and is a model: its spec resolves, every tensor the spec needs
    lies inside its safetensors file(s) with the right shape, and (if `tokenizer`) its
    tokenizer loads."""
    if not cfg.path:
        return
    from rl_jax.models.load import resolve_spec

    path = Path(cfg.path)
    if not path.exists():
        raise ConfigError(
            f"model.path={cfg.path!r} does not exist (an HF directory, a GGUF file or an "
            "rl_jax model directory)"
        )
    if not path.is_dir() and path.suffix != ".gguf":
        raise ConfigError(
            f"model.path={cfg.path!r} is neither a directory (HF or rl_jax model) nor a .gguf file"
        )
    spec = resolve_spec(cfg)  # reads config.json / rl_jax_model.json / the GGUF header
    if path.is_dir():
        from rl_jax.models.hf import check_hf_shapes, hf_weight_files
        from rl_jax.models.native import PARAMS_FILE, is_native_dir
        from rl_jax.models.safetensors_io import check_safetensors

        if is_native_dir(path):
            check_safetensors(path / PARAMS_FILE)
        else:
            shapes = {}
            for f in hf_weight_files(path):
                shapes.update({n: s for n, (_, s) in check_safetensors(f).items()})
            check_hf_shapes(spec, shapes, where=str(path))
    if tokenizer:
        from rl_jax.models.tokenizer import load_tokenizer

        load_tokenizer(path)


def check_data_files(data: DataConfig) -> str:
    """Reads the data files a DataConfig names (data.path, data.val_path, data.split_file),
    every row checked; returns the task's verifier name ('' when not known without
    opening a dataset)."""
    if data.source != "file" and not data.split_file:
        return data.source if data.source in ("arith", "countdown") else ""
    from rl_jax.data import build_task

    task = build_task(data)
    if not len(task.val):
        raise ConfigError(
            f"data.source={data.source!r} leaves no validation problems (data.val_path, "
            "data.val_size, data.split_name)"
        )
    return task.reward_name


def check_reward(rewards: RewardConfig, *, task_reward: str) -> None:
    """The verifier can be built (its optional dependency is installed)."""
    from rl_jax.rewards import from_config

    if rewards.name == "auto" and not task_reward:
        return
    try:
        # Building it starts nothing: a sandboxed verifier's pool starts at its first call.
        from_config(rewards, task_reward=task_reward)
    except ImportError as e:
        raise ConfigError(f"rewards.name={rewards.name!r}: {e}") from None
    except KeyError as e:  # rewards.name=auto picked a name the registry lacks
        raise ConfigError(f"rewards.name={rewards.name!r}: {e.args[0]}") from None
