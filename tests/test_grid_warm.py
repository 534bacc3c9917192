"""GridSpec.warm_start_overrides: both arms of a precision ablation share one warm-up."""

from __future__ import annotations

import types

import pytest

from rl_jax.config import ConfigError, load_recipe, resolved, to_dict
from rl_jax.grid import expand, load_spec
from rl_jax.models import resolve_spec

SPEC = "scalerl_fp32head_bf16_cpu"


def test_the_bf16_pair_differs_in_the_head_only():
    plans = expand(load_spec(SPEC))
    assert len(plans) == 6  # two arms x 3 seeds
    cfgs = {(p.group, p.seed): p.config for p in plans}
    for s in (0, 1, 2):
        base, off = to_dict(cfgs["scalerl", s]), to_dict(cfgs["fp32head=off", s])
        assert base["model"]["compute_dtype"] == "bfloat16"
        assert base["model"]["param_dtype"] == "float32"
        assert base["train"]["precision"] == "fp32_master"
        diff = {
            (sec, k)
            for sec in base
            if isinstance(base[sec], dict)
            for k in base[sec]
            if base[sec][k] != off[sec][k]
        }
        assert diff == {("model", "fp32_lm_head")}, diff


def test_warm_set_reaches_warm_train_and_keys_the_float32_warm_up():
    from rl_jax.cli.grid import build_parser, make_backend
    from rl_jax.cli.warm_train import WarmUpView, warm_up_config

    spec = load_spec(SPEC)
    cmd = make_backend(build_parser().parse_args([SPEC]), spec).train_cmd
    warm_set = ["model.compute_dtype='float32'", "model.fp32_lm_head=true"]
    assert cmd[-4:] == ["--warm-set", warm_set[0], "--warm-set", warm_set[1]]
    tpu = make_backend(
        build_parser().parse_args([SPEC, "--backend", "tpu", "--tpu-zone", "z"]), spec
    )
    assert tpu.remote_train_cmd[-4:] == cmd[-4:]

    plans = {p.group: p for p in expand(spec) if p.seed == 1}
    f32 = resolved(load_recipe("scalerl", [*plans["scalerl"].overrides, *warm_set[:1]]))
    for arm in ("scalerl", "fp32head=off"):
        args = plans[arm].train_args("scalerl", out_dir="x")
        cfg = warm_up_config(args[0], args[1:], warm_set)
        # the warm-up's cache key (rl_jax.train.demo.warm_start): the float32 baseline's
        assert to_dict(cfg.model) == to_dict(f32.model)
        assert to_dict(cfg.data) == to_dict(f32.data) and cfg.train.seed == 1
        run_cfg = load_recipe(args[0], args[1:])
        trainer = types.SimpleNamespace(spec=resolve_spec(run_cfg.model), tokenizer="tok")
        view = WarmUpView(trainer, cfg)
        assert view.spec == resolve_spec(f32.model) and view.cfg is cfg
        assert view.tokenizer == "tok"  # the rest is the run's trainer


def test_warm_start_overrides_are_checked():
    spec = load_spec(SPEC)
    with pytest.raises(ConfigError, match="'model.param_dtype' is not one of"):
        spec.replace(warm_start_overrides={"model.param_dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="needs warm_start > 0"):
        spec.replace(warm_start=0.0)
    from rl_jax.cli.warm_train import main

    with pytest.raises(ConfigError, match="--warm-set 'train.lr=1.0'"):
        main(["--target", "0.4", "--warm-set", "train.lr=1.0", "scalerl"])
