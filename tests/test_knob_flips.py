"""One flag is one ablation: each knob of each shipped recipe, switched alone to each value
it may take, gives a config that is accepted, or refused for a reason of its own: never
because a knob that depends on it kept the recipe's value (that knob takes its default:
rl_jax.config.apply_overrides). Config resolution only, no device work."""

from __future__ import annotations

import functools
import re
import types
import typing

import pytest

from rl_jax.config import (
    ConfigError,
    RunConfig,
    all_keys,
    apply_overrides,
    flatten,
    knob_default,
    load_recipe,
    replace_knobs,
    run_id,
)
from rl_jax.config import data as data_cfg
from rl_jax.config import loss as loss_cfg
from rl_jax.config import mesh as mesh_cfg
from rl_jax.config import model as model_cfg
from rl_jax.config import rewards as rewards_cfg
from rl_jax.config import sampling as sampling_cfg
from rl_jax.config import train as train_cfg
from rl_jax.config._run import EXPERIMENTS_DIR
from rl_jax.models import PRESETS
from rl_jax.rewards import names as reward_names

# The values a text knob may take (None added where the knob is optional).
ENUMS = {
    "model.preset": sorted(PRESETS),
    "model.architecture": ["", *model_cfg.ARCHITECTURES],
    "model.param_dtype": model_cfg.DTYPES,
    "model.compute_dtype": model_cfg.DTYPES,
    "model.tie_embeddings": model_cfg.TIE_CHOICES,
    "model.norm_topk_prob": model_cfg.NORM_TOPK_CHOICES,
    "model.remat": model_cfg.REMAT_CHOICES,
    "model.scan_layers": ["auto", True, False],
    "model.attention": model_cfg.ATTENTION_CHOICES,
    "sampling.length_control": sampling_cfg.LENGTH_CONTROL,
    "loss.name": loss_cfg.loss_names(),
    "loss.aggregation": loss_cfg.AGGREGATIONS,
    "loss.advantage": loss_cfg.ADV_ESTIMATORS,
    "loss.adv_norm": loss_cfg.ADV_NORMS,
    "loss.kl_estimator": loss_cfg.KL_ESTIMATORS,
    "data.source": data_cfg.SOURCES,
    "data.format": data_cfg.FILE_FORMATS,
    "data.task": data_cfg.ARITH_TASKS,
    "data.answer_extract": data_cfg.ANSWER_EXTRACTS,
    "rewards.name": ["auto", *reward_names()],
    "rewards.scale": rewards_cfg.SCALES,
    "train.off_policy": train_cfg.OFF_POLICY,
    "train.schedule": train_cfg.SCHEDULES,
    "train.precision": train_cfg.PRECISIONS,
    "mesh.rules": mesh_cfg.RULE_PRESETS,
}
# Text knobs with no list of values: names, paths, templates, free text.
FREE_TEXT = {
    "name",
    "out_dir",
    "recipe",
    "model.path",
    "data.path",
    "data.val_path",
    "data.hf_split",
    "data.hf_val_split",
    "data.gym_kwargs",
    "data.split_file",
    "data.split_name",
    "data.prompt_template",
    "data.system_prompt",
    "data.answer_instruction",
    "data.question_field",
    "data.answer_field",
    "data.answer_regex",
    "data.mixture",
    "sampling.interrupt_text",
    "lora.targets",
    "logging.wandb_project",
    "mesh.coordinator_address",
}

# Refusals for a reason of the switched knob's own: (key, value or ANY) -> what the one
# line says. Each is a value that cannot work with the recipe's other choices whatever
# they are (not a dependent knob's leftover), or a value below what the knob allows.
ANY = object()
OWN_REASONS = {
    # A dataset source needs the dataset named.
    ("data.source", "file"): r"data.source='file' needs data.path",
    ("data.source", "hf"): r"data.source='hf' needs data.path",
    # PipelineRL runs only as a stream on the engine.
    ("train.off_policy", "pipeline"): r"train.off_policy='pipeline' runs as a stream",
    # The CPU recipes' 10-token budget has no room for the default injected text.
    ("sampling.length_control", "interrupt"): r"max_new_tokens=\d+ leaves no room for an",
    # A knob that needs another's value, switched on alone where that is absent.
    ("data.answer_extract", "regex"): r"data.answer_extract='regex' needs data.answer_regex",
    ("rewards.name", "mixture"): r"rewards.name='mixture' .* needs data.mixture",
    ("lora.lr_scale", ANY): r"lora.lr_scale=.* needs lora.enabled=true",
    # The knob's own value is one another choice of the recipe rules out.
    ("train.off_policy_k", ANY): r"train.off_policy_k=\d+ needs train.off_policy in",
    ("model.value_head", False): r"trains a critic: it needs model.value_head=true",
    ("loss.adv_norm", "prompt"): r"loss.adv_norm='prompt' normalizes group advantages",
    ("rewards.overlong_max", ANY): r"needs 0 < rewards.overlong_cache < rewards.overlong_max",
    ("rewards.overlong_cache", ANY): r"needs 0 < rewards.overlong_cache < rewards.overlong_max",
}


def _recipes() -> list[str]:
    names = []
    for path in sorted(EXPERIMENTS_DIR.glob("*.py")):
        if not path.stem.startswith("_") and "def recipe(" in path.read_text():
            names.append(path.stem)
    return names


@functools.cache
def _kind(key: str) -> tuple[type, bool]:
    """(the knob's type, whether it takes None)."""
    section, _, name = key.rpartition(".")
    cls = typing.get_type_hints(RunConfig)[section] if section else RunConfig
    t = typing.get_type_hints(cls)[name]
    if isinstance(t, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(t))
    return typing.get_origin(t) or t, False


def alternatives(key: str, value) -> list:
    """The values other than `value` that a switch of `key` tries."""
    t, optional = _kind(key)
    if key in FREE_TEXT:
        return []
    if key in ENUMS:
        out = list(ENUMS[key])
    elif t is bool:
        out = [True, False]
    elif t in (int, float):
        out = [knob_default(key)]
        if key == "lora.lr_scale":
            out.append(1.0)
    elif t is list:
        out = [[]]
    else:
        raise AssertionError(f"{key}: classify it (ENUMS, FREE_TEXT or a number)")
    if optional:
        out.append(None)
    return [v for v in dict.fromkeys(map(_hashable, out)) if v != _hashable(value)]


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


def _expected(key: str, value) -> str | None:
    return OWN_REASONS.get((key, value)) or OWN_REASONS.get((key, ANY))


def test_every_knob_is_classified():
    for key in all_keys():
        alternatives(key, object())


RECIPES = _recipes()


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_knob_switched_alone_is_accepted_or_refused_for_its_own_reason(recipe, capsys):
    try:
        base = load_recipe(recipe)
    except ConfigError as e:  # a recipe whose model package is not installed
        pytest.skip(str(e))
    flat = flatten(base)
    refused, accepted = {}, 0
    for key in all_keys():
        for value in alternatives(key, flat[key]):
            v = list(value) if isinstance(value, tuple) else value
            try:
                cfg = replace_knobs(base, {key: v})
            except ConfigError as e:
                refused[(key, value)] = str(e)
                continue
            assert flatten(cfg)[key] == v, (key, v)
            run_id(cfg)  # resolves it
            accepted += 1
    capsys.readouterr()  # the notes of released knobs
    unexplained = {
        k: msg
        for k, msg in refused.items()
        if not (_expected(*k) and re.search(_expected(*k), msg))
    }
    assert not unexplained, f"{recipe}: refused {len(unexplained)} switches:\n" + "\n".join(
        f"  {k}={v!r}: {msg}" for (k, v), msg in unexplained.items()
    )
    assert accepted > 100, accepted


# ---- the release of a dependent knob, through the command line --------------------------


def test_switching_the_off_policy_mode_alone_trains_on_policy(capsys):
    from rl_jax.cli import main

    assert main(["config", "scalerl", "train.off_policy=on_policy", "--format", "flat"]) == 0
    out, err = capsys.readouterr()
    assert "train.off_policy=on_policy\n" in out and "train.off_policy_k=1\n" in out
    assert err.count("note: train.off_policy_k takes its default, 1") == 1, err
    end_only = ["checkpoint.every=0"]  # the recipe's interval when this id was handed out
    alone = load_recipe("scalerl", ["train.off_policy=on_policy", *end_only])
    both = load_recipe("scalerl", ["train.off_policy=on_policy", "train.off_policy_k=1", *end_only])
    assert alone == both and run_id(alone) == run_id(both) == "v2cb7b78ec9ada"
    # ppo_off_policy takes k: the recipe's 8 stays.
    assert load_recipe("scalerl", ["train.off_policy=ppo_off_policy"]).train.off_policy_k == 8


@pytest.mark.parametrize(
    "overrides, names",
    [
        # Both set on one command line: checked together, as given.
        (["train.off_policy=on_policy", "train.off_policy_k=8"], ["train.off_policy_k=8"]),
        # The dependent knob alone, against the recipe's mode: its own value is refused.
        (["train.pipeline_waves=2", "train.off_policy=ppo_off_policy"], ["pipeline_waves=2"]),
        (["lora.rank=4"], ["lora.rank=4", "lora.enabled=true"]),
        (["model.value_head=false", "loss.name=ppo"], ["model.value_head=true"]),
    ],
)
def test_a_dependent_knob_set_on_the_command_line_is_not_released(capsys, overrides, names):
    from rl_jax.cli import main

    assert main(["config", "scalerl", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "note:" not in err, err
    for n in names:
        assert n in err, err


@pytest.mark.parametrize(
    "recipe, key, value, released",
    [
        ("scalerl", "train.off_policy", "on_policy", {"train.off_policy_k": 1}),
        ("minimax", "train.off_policy", "on_policy", {"train.off_policy_k": 1}),
        ("grpo", "loss.name", "ppo", {"loss.adv_norm": None, "model.value_head": None}),
        ("grpo", "loss.advantage", "gae", {"loss.adv_norm": None}),
    ],
)
def test_both_ways_of_setting_a_knob_release_the_same(recipe, key, value, released, capsys):
    base = load_recipe(recipe)
    text = {True: "true", False: "false", None: "null"}.get(value, value)
    by_text = apply_overrides(base, [f"{key}={text}"])
    assert by_text == replace_knobs(base, {key: value})
    flat = flatten(by_text)
    assert {k: flat[k] for k in released} == released
    assert "note: " in capsys.readouterr().err
    # What a switch leaves unset resolves to what goes with it: a critic for GAE.
    if value in ("ppo", "gae"):
        from rl_jax.config import resolved

        r = resolved(by_text)
        assert r.model.value_head is True and r.loss.adv_norm == "batch"


def test_turning_lora_off_releases_its_knobs(capsys):
    lora = replace_knobs(
        load_recipe("grpo"),
        {"lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0, "lora.lr_scale": 5.0},
    )
    off = apply_overrides(lora, ["lora.enabled=false"])
    assert off.lora == load_recipe("grpo").lora
    assert capsys.readouterr().err.count("note: lora.") == 3
    assert run_id(off) == run_id(load_recipe("grpo"))
