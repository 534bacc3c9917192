"""Typed, frozen run configs; recipes; dotted `key=value` overrides."""

from rl_jax.config._run import (
    ID_VERSION,
    OverrideError,
    RunConfig,
    all_keys,
    apply_overrides,
    describe_knobs,
    experiments_dir,
    flatten,
    from_dict,
    id_version,
    knob_default,
    load_recipe,
    replace_knobs,
    rerun_id,
    resolve_recipe_path,
    resolved,
    run_id,
    to_dict,
    to_yaml,
)
from rl_jax.config.data import DataConfig
from rl_jax.config.logging import LoggingConfig
from rl_jax.config.lora import LoraConfig
from rl_jax.config.loss import LossConfig
from rl_jax.config.mesh import MeshConfig
from rl_jax.config.model import ModelConfig
from rl_jax.config.rewards import RewardConfig
from rl_jax.config.sampling import SamplingConfig
from rl_jax.config.train import CheckpointConfig, EvalConfig, TrainConfig
from rl_jax.knobs import ConfigError, check_choice, check_range, knob, sub

__all__ = [
    "ID_VERSION",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "MeshConfig",
    "ModelConfig",
    "RewardConfig",
    "SamplingConfig",
    "TrainConfig",
    "ConfigError",
    "OverrideError",
    "RunConfig",
    "all_keys",
    "apply_overrides",
    "check_choice",
    "check_range",
    "describe_knobs",
    "experiments_dir",
    "flatten",
    "from_dict",
    "id_version",
    "knob",
    "knob_default",
    "load_recipe",
    "replace_knobs",
    "rerun_id",
    "resolve_recipe_path",
    "resolved",
    "run_id",
    "sub",
    "to_dict",
    "to_yaml",
]
