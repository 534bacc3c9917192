import dataclasses
import json
import subprocess
import sys

import pytest

from rl_jax.config import (
    ID_VERSION,
    ConfigError,
    LossConfig,
    OverrideError,
    RunConfig,
    TrainConfig,
    apply_overrides,
    flatten,
    from_dict,
    id_version,
    knob,
    load_recipe,
    rerun_id,
    run_id,
    sub,
    to_dict,
)


def test_recipe_loads_and_overrides_apply():
    cfg = load_recipe("experiments/scalerl.py", ["loss.name=grpo", "train.lr=3e-4", "sampling.n=4"])
    assert cfg.loss.name == "grpo"
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.sampling.n == 4
    assert cfg.recipe == "scalerl"
    # by name too
    assert load_recipe("scalerl").loss.name == "cispo"


def test_round_trip_through_dict_and_json():
    cfg = load_recipe("scalerl", ["sampling.stop_token_ids=[1,2]"])
    again = from_dict(json.loads(json.dumps(to_dict(cfg))))
    assert again == cfg
    assert again.sampling.stop_token_ids == [1, 2]


def test_configs_are_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loss.name = "ppo"  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("loss.nmae=cispo", "loss.name"),
        ("lr=1e-3", "train.lr"),
        ("train.lr=fast", "expected float"),
        ("train.steps=1.5", "expected int"),
        ("loss.name=cisp", "'cispo'"),
        ("loss.aggregation=mean", "['token', 'sample', 'prompt', 'seq_sum']"),
        ("noequals", "key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        apply_overrides(RunConfig(), [override])
    assert fragment in str(e.value)


def test_unknown_key_is_an_override_error():
    with pytest.raises(OverrideError):
        apply_overrides(RunConfig(), ["loss.nmae=cispo"])


def test_validation_in_post_init():
    with pytest.raises(ConfigError, match="loss.eps_max"):
        LossConfig(eps_max=0.0)
    with pytest.raises(ConfigError, match="train.off_policy_k"):
        apply_overrides(RunConfig(), ["train.off_policy_k=4"])


def test_run_id_stable_and_sensitive():
    a = load_recipe("scalerl")
    b = load_recipe("scalerl")
    assert run_id(a) == run_id(b)
    # names and output paths do not change the id; knobs and seeds do
    assert run_id(dataclasses.replace(a, name="other", out_dir="/tmp/x")) == run_id(a)
    assert run_id(apply_overrides(a, ["train.seed=1"])) != run_id(a)
    assert run_id(apply_overrides(a, ["loss.eps_max=4.0"])) != run_id(a)
    # any slot count: the same tokens, the same run; any LM-head chunking: the same numbers
    assert run_id(apply_overrides(a, ["sampling.engine_slots=8"])) == run_id(a)
    assert run_id(apply_overrides(a, ["model.logprob_chunk=0"])) == run_id(a)
    assert run_id(apply_overrides(a, ["model.logprob_chunk=16"])) == run_id(a)


def test_a_knob_added_with_a_default_changes_no_run_id():
    """A config dataclass given one more knob (a subclass here, as a commit would add a
    field): every config keeps its id while the knob is at its default; set, it counts."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class TrainPlus(TrainConfig):
        added: float = knob(0.5, help="a knob added later")

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class RunPlus(RunConfig):
        train: TrainPlus = sub(TrainPlus, "RL loop and optimizer")

    def plus(cfg: RunConfig, **train) -> RunPlus:
        sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)}
        return RunPlus(**{**sections, "train": TrainPlus(**{**vars(cfg.train), **train})})

    configs = [RunConfig(), load_recipe("grpo"), load_recipe("minimax")]
    configs += [apply_overrides(load_recipe("scalerl"), o) for o in ([], ["lora.enabled=true"])]
    for cfg in configs:
        assert flatten(plus(cfg))["train.added"] == 0.5
        assert run_id(plus(cfg)) == run_id(cfg)
        assert run_id(plus(cfg, added=0.25)) != run_id(cfg)
    assert len({run_id(c) for c in configs}) == len(configs)


def test_run_ids_carry_their_version_and_equal_spellings_hash_alike():
    a = load_recipe("scalerl")
    assert id_version(run_id(a)) == ID_VERSION and run_id(a).startswith(f"v{ID_VERSION}")
    assert id_version("2c638758e0a3") == 1 and id_version("v3" + "0" * 12) == 3
    assert id_version("run") is id_version("v2xyz") is id_version(None) is None
    # Set in a recipe (an int, a bool) or on a command line (50.0, 'full'): one config.
    by_recipe = dataclasses.replace(
        a,
        train=dataclasses.replace(a.train, warmup_steps=50),
        data=dataclasses.replace(a.data, val_size=128),
        model=dataclasses.replace(a.model, remat=True),
    )
    by_flag = apply_overrides(a, ["train.warmup_steps=50.0", "data.val_size=128.0"])
    by_flag = apply_overrides(by_flag, ["model.remat=full"])
    assert by_recipe.train.warmup_steps == 50.0 and isinstance(by_recipe.train.warmup_steps, float)
    assert to_dict(by_recipe) == to_dict(by_flag) and run_id(by_recipe) == run_id(by_flag)


def test_rerun_id_takes_up_only_runs_that_run_as_they_ran():
    cfg = load_recipe("scalerl", ["train.off_policy=pipeline"])
    stored = to_dict(cfg)
    assert rerun_id(stored) == run_id(cfg)
    # A config.json from before a knob existed loads with its default; where that default
    # resolves to the value it has in the default config, the run ran as it does today.
    older = {**stored, "data": {k: v for k, v in stored["data"].items() if k != "mixture"}}
    assert rerun_id(older) == run_id(cfg)
    # LoRA without lora.lr_scale trained at train.lr, not at the 10x it resolves to now.
    lora = to_dict(apply_overrides(cfg, ["lora.enabled=true"]))
    assert rerun_id(lora) == run_id(apply_overrides(cfg, ["lora.enabled=true"]))
    lora["lora"] = {k: v for k, v in lora["lora"].items() if k != "lr_scale"}
    assert rerun_id(lora) is None
    # PipelineRL sampled in waves where sampling.stream was false; the stream is all now.
    waves = {**stored, "sampling": {**stored["sampling"], "stream": False}}
    assert rerun_id(waves) is None
    assert rerun_id({**waves, "sampling": {**stored["sampling"], "stream": True}}) == run_id(cfg)
    on_policy = to_dict(load_recipe("scalerl", ["train.off_policy=on_policy"]))
    on_policy["sampling"] = {**on_policy["sampling"], "stream": False, "engine": False}
    assert rerun_id(on_policy) == run_id(load_recipe("scalerl", ["train.off_policy=on_policy"]))
    assert rerun_id({"train": {"steps": "x"}}) is None and rerun_id(None) is None


def test_processes_of_one_run_share_its_id():
    a = load_recipe("scalerl", ["mesh.distributed=true", "mesh.num_processes=2"])
    ids = {
        run_id(apply_overrides(a, [f"mesh.process_id={i}", f"mesh.coordinator_address=h:{p}"]))
        for i, p in ((0, 1234), (1, 1234), (1, 999))
    }
    assert len(ids) == 1


def test_flatten_has_every_knob():
    flat = flatten(RunConfig())
    assert flat["loss.name"] == "cispo"
    assert "sampling.n" in flat and "mesh.fsdp" in flat


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "rl_jax.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_config_and_errors():
    r = _cli("config", "experiments/scalerl.py", "loss.name=cispo")
    assert r.returncode == 0, r.stderr
    assert "name: cispo" in r.stdout
    r = _cli("config", "experiments/scalerl.py", "loss.nmae=cispo")
    assert r.returncode == 2
    assert "loss.name" in r.stderr
    r = _cli("--help")
    assert r.returncode == 0
    for cmd in ("train", "grid", "fit", "sample", "convert", "config"):
        assert cmd in r.stdout
    assert "loss.eps_max" in r.stdout


def test_every_advertised_command_exists():
    import importlib

    from rl_jax.cli import COMMANDS

    for name, (module, _) in COMMANDS.items():
        assert callable(importlib.import_module(module).main), name
