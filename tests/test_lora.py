"""LoRA: adapters on a frozen base (rl_jax.train.params), trained, sampled, saved, exported."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_jax.config import LoraConfig, LossConfig, ModelConfig, load_recipe
from rl_jax.knobs import ConfigError
from rl_jax.models import init_params, resolve_spec
from rl_jax.runs import read_jsonl
from rl_jax.sharding import get_rules
from rl_jax.train.loop import RLTrainer
from rl_jax.train.params import LORA_KEY, ParamFormat, check_lora, tree_bytes
from rl_jax.train.step import assemble_batch, make_update, put_minibatches

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

ALL = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def _spec(**kw):
    base = dict(
        preset="tiny",
        num_layers=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        tie_embeddings="false",
    )
    return resolve_spec(ModelConfig(**{**base, **kw}))


def _plan(rank=4, alpha=8.0, targets=ALL, **kw):
    return ParamFormat(lora_rank=rank, lora_scale=alpha / rank, lora_targets=targets, **kw)


def _state(spec, plan, seed=0):
    weights = init_params(spec, jax.random.key(seed))
    return weights, plan.init_state(weights, key=jax.random.key(seed + 1), mesh=None)


def test_b_starts_at_zero_so_the_view_is_the_base():
    spec = _spec()
    weights, state = _state(spec, _plan())
    assert set(state[LORA_KEY]) == set(ALL)
    for t, ab in state[LORA_KEY].items():
        assert not np.any(np.asarray(ab["b"])), t
        assert np.std(np.asarray(ab["a"])) > 0, t
    view = _plan().view(state)
    assert set(view) == set(weights)
    for k, w in weights.items():
        np.testing.assert_array_equal(np.asarray(view[k]), np.asarray(w), err_msg=k)


def test_the_view_is_w_plus_alpha_over_r_times_ab():
    spec = _spec()
    plan = _plan(rank=3, alpha=6.0)
    weights, state = _state(spec, plan)
    rng = np.random.default_rng(0)
    state[LORA_KEY] = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), state[LORA_KEY]
    )
    view = plan.view(state)
    L, D, H, hd = spec.num_layers, spec.hidden_size, spec.num_heads, spec.head_dim
    for t in ALL:
        a = np.asarray(state[LORA_KEY][t]["a"], np.float64)
        b = np.asarray(state[LORA_KEY][t]["b"], np.float64)
        w = np.asarray(weights[t], np.float64)
        delta = 2.0 * (a @ b)  # alpha / r = 6 / 3
        want = w + delta.reshape(w.shape)
        np.testing.assert_allclose(np.asarray(view[t]), want, rtol=1e-5, atol=1e-5, err_msg=t)
    # The output projection reads its H x hd inputs as rows of A.
    assert state[LORA_KEY]["o"]["a"].shape == (L, H * hd, 3)
    assert state[LORA_KEY]["o"]["b"].shape == (L, 3, D)
    # Weights without adapters are the base.
    np.testing.assert_array_equal(np.asarray(view["embed"]), np.asarray(weights["embed"]))


@pytest.mark.parametrize(
    "plan",
    [
        _plan(param_dtype="bfloat16", targets=("q", "o", "down")),
        ParamFormat(param_dtype="bfloat16", precision="fp32_master"),
        ParamFormat(param_dtype="bfloat16", precision="pure"),
    ],
    ids=["lora", "fp32_master", "pure"],
)
def test_the_abstract_state_is_the_state(plan):
    """rl-jax plan and benchmarks/train_memory.py count `abstract_state`'s bytes."""
    spec = _spec(param_dtype="bfloat16")
    _, state = _state(spec, plan)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), plan.abstract_state(spec))
    assert got == jax.tree.map(lambda x: (x.shape, x.dtype), state)


def _batch(rows=8, tp=6, tg=6, seed=0):
    rng = np.random.default_rng(seed)
    host = assemble_batch(
        rng.integers(1, 60, (rows, tp)).astype(np.int32),
        np.ones((rows, tp), bool),
        rng.integers(1, 60, (rows, tg)).astype(np.int32),
        np.full((rows,), tg, np.int32),
        np.ones((rows, tg), np.float32),
        np.full((rows, tg), -3.0, np.float32),
        rng.standard_normal(rows).astype(np.float32),
        np.repeat(np.arange(2, dtype=np.int32), rows // 2),
    )
    return put_minibatches(host, None, num_minibatches=1, groups=2)


def _step(spec, plan, tx):
    return make_update(
        spec,
        get_rules("fsdp", purpose="train"),
        None,
        tx,
        LossConfig(name="grpo", advantage="grpo", kl_coef=0.0),
        num_groups=2,
        max_tokens=6,
        temperature=1.0,
        plan=plan,
    )


def test_updates_reach_only_the_adapters_and_their_optimizer_state_is_small():
    spec = _spec()
    plan = _plan(rank=2, targets=("q", "v"))
    tx = optax.adamw(1e-2)
    weights, state = _state(spec, plan)
    before = jax.tree.map(np.asarray, state)
    opt = plan.init_optimizer(tx, state)
    full = ParamFormat()
    full_opt = full.init_optimizer(tx, full.init_state(weights, key=None, mesh=None))
    # Adam's two moments per trained weight: of q and v's adapters only.
    lora_bytes, full_bytes = tree_bytes(opt), tree_bytes(full_opt)
    adapter_bytes = tree_bytes(state[LORA_KEY])
    assert lora_bytes <= 2 * adapter_bytes + 64, (lora_bytes, adapter_bytes)
    assert lora_bytes <= full_bytes / 2, (lora_bytes, full_bytes)

    step = _step(spec, plan, tx)
    state, opt, m = step(state, opt, _batch())
    assert float(m["nonfinite"][0]) == 0
    for k in weights:
        np.testing.assert_array_equal(np.asarray(state[k]), before[k], err_msg=k)
    for t in ("q", "v"):
        for part in ("a", "b"):
            after = np.asarray(state[LORA_KEY][t][part])
            assert not np.array_equal(after, before[LORA_KEY][t][part]), (t, part)


def test_rank_and_targets_are_checked_against_the_model():
    with pytest.raises(ConfigError, match="lora.rank"):
        LoraConfig(enabled=True, rank=0)
    with pytest.raises(ConfigError, match=r"lora.targets.*'qq'"):
        LoraConfig(enabled=True, targets="q,qq")
    with pytest.raises(ConfigError, match="lora.rank=16 needs lora.enabled=true"):
        LoraConfig(rank=16)
    tied = _spec(tie_embeddings="true")
    with pytest.raises(ConfigError, match="lm_head.*tied"):
        check_lora(tied, ("q", "lm_head"), 4)
    with pytest.raises(ConfigError, match="lora.rank=40 exceeds 'q'"):
        check_lora(_spec(), ("q",), 40)
    check_lora(_spec(), ALL, 4)


# ---- the trainer --------------------------------------------------------------------------

# At the full fine-tune's learning rate (TINY_RUN's train.lr=1e-3, the trainer tests' full
# fine-tunes' rate): the adapters train at lora.lr_scale's default 10x that.
LORA_RUN = [
    *train_even_first.TINY_RUN,
    "lora.enabled=true",
    "lora.rank=4",
    "lora.targets=q,v,o,gate,up,down",
    "train.warmup_steps=0",
    "train.steps=10",
    "eval.every=0",
    "eval.at_start=false",
    "checkpoint.every=4",
    "checkpoint.async_save=false",
]


def _trainer(root, name, *extra):
    cfg = load_recipe("scalerl", [*LORA_RUN, f"out_dir={root}", f"name={name}", *extra])
    return RLTrainer(cfg, quiet=True)


def _rows(run_dir: Path):
    drop = ("time/", "device_seconds", "eval_device_seconds")
    return [
        {k: v for k, v in r.items() if not k.startswith(drop) and k not in drop}
        for r in read_jsonl(run_dir / "metrics.jsonl")
    ]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    tr = _trainer(root, "ref")
    base = {k: np.asarray(v) for k, v in tr.params.items() if k != LORA_KEY}
    sampled = [tr.sampler_weights()[0]]
    tr.step_hooks.append(lambda t: sampled.append(t.sampler_weights()[0]))
    tr.run_loop()
    return root, tr, base, sampled


def test_a_lora_run_learns_with_a_frozen_base_and_a_small_optimizer_state(lora_run):
    root, tr, base, sampled = lora_run
    rows = _rows(root / "ref")
    assert tr.cfg.train.lr == 1e-3 and float(tr.parts.lr_at(0)) == pytest.approx(1e-2)
    # The probability of an even first digit (what the verifier rewards), step by step
    # (measured: 0.0781 at the start, 0.0870 after 10 steps, rising in 8 of them; with
    # the adapters at train.lr itself, lora.lr_scale=1: 0.0805, +0.0024).
    mass = [train_even_first.even_first_mass(tr, w) for w in sampled]
    print("lora: P(even first digit) by step", np.round(mass, 4).tolist())
    assert mass[-1] > mass[0] + 0.005, mass
    assert np.mean(mass[-3:]) > np.mean(mass[:3]), mass
    for k, v in base.items():
        np.testing.assert_array_equal(np.asarray(tr.params[k]), v, err_msg=k)
    fmt = tr.parts.param_format
    full = ParamFormat(param_dtype=fmt.param_dtype, precision=fmt.precision)
    weights = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in base.items()}
    full_opt = jax.eval_shape(lambda w: full.init_optimizer(tr.parts.tx, w), weights)
    print("optimizer bytes: lora", tree_bytes(tr.state.opt_state), "full", tree_bytes(full_opt))
    assert tree_bytes(tr.state.opt_state) <= tree_bytes(full_opt) / 2
    # On policy, the sampler ran the weights the loss saw: importance ratios are 1.
    ratios = [r[k] for r in rows for k in ("train/ratio_max", "train/ratio_min") if k in r]
    assert ratios and np.allclose(ratios, 1.0, atol=1e-4), ratios


def test_the_sampler_runs_the_merged_weights(lora_run):
    _, tr, base, sampled = lora_run
    merged = tr.parts.param_format.view(tr.params)
    last = sampled[-1]
    assert set(last) == set(base)
    for k in base:  # the sampler's copy is merged by a compiled view: float32 rounding apart
        np.testing.assert_allclose(
            np.asarray(last[k]), np.asarray(merged[k]), rtol=1e-6, atol=1e-7, err_msg=k
        )
    assert not np.array_equal(np.asarray(last["q"]), base["q"])  # the adapters moved it


def test_lora_resume_is_exact_and_checkpoints_hold_the_adapters(lora_run, tmp_path):
    root, tr, _, _ = lora_run
    crashed = _trainer(root, "crash")

    class Crash(Exception):
        pass

    def hook(t):
        if t.step == 6:
            raise Crash

    crashed.step_hooks.append(hook)
    with pytest.raises(Crash):
        crashed.run_loop()
    saved = sorted(
        int(d.name) for d in (root / "crash" / "checkpoints").iterdir() if d.name.isdigit()
    )
    assert saved == [4]
    resumed = _trainer(root, "crash")
    resumed.run_loop()
    assert _rows(root / "crash") == _rows(root / "ref")
    for t, ab in tr.params[LORA_KEY].items():
        for part, x in ab.items():
            np.testing.assert_array_equal(
                np.asarray(resumed.params[LORA_KEY][t][part]), np.asarray(x), err_msg=(t, part)
            )


def test_convert_exports_the_merged_weights(lora_run, tmp_path, capsys):
    from rl_jax.cli import main
    from rl_jax.models.load import load_model

    root, tr, _, _ = lora_run
    rc = main(["convert", str(root / "ref"), str(tmp_path / "hf")])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["step"] == 10
    model = load_model(ModelConfig(path=str(tmp_path / "hf")))
    from rl_jax.models import model_params

    got = model_params(model)
    merged = tr.parts.param_format.view(tr.params)
    for k in merged:
        np.testing.assert_allclose(
            np.asarray(got[k]), np.asarray(merged[k]), rtol=1e-6, atol=1e-6, err_msg=k
        )
    # The tokenizer the run trained with travels with the merged weights.
    from rl_jax.data.tokenizer import CharTokenizer
    from rl_jax.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tmp_path / "hf")
    assert tok.encode("12+34=") == CharTokenizer().encode("12+34=")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == CharTokenizer.eos_id


# ---- bad knobs: one line, exit 2, before any device work ------------------------------------


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["lora.enabled=true", "lora.rank=0"], ["lora.rank"]),
        (["lora.enabled=true", "lora.rank=-3"], ["lora.rank"]),
        (["lora.enabled=true", "lora.targets=q,attn"], ["lora.targets", "'attn'"]),
        (["lora.enabled=true", "lora.alpha=0"], ["lora.alpha"]),
        (["lora.rank=4"], ["lora.rank", "lora.enabled=true"]),
        (["train.precision=bf16"], ["train.precision"]),
        # the model, not the knob: a tied head has no lm_head; the rank above a side
        (["lora.enabled=true", "lora.targets=lm_head", "model.tie_embeddings=true"], ["lm_head"]),
        (["lora.enabled=true", "lora.rank=100000", "model.preset=tiny"], ["lora.rank=100000"]),
    ],
)
def test_bad_lora_knobs_exit_2_before_the_trainer(capsys, tmp_path, monkeypatch, overrides, names):
    import rl_jax.train.loop as loop
    from rl_jax.cli import main

    def tripwire(*a, **k):
        raise AssertionError("bad input reached the trainer")

    monkeypatch.setattr(loop, "train", tripwire)
    argv = ["train", "grpo", *overrides, "--run-dir", str(tmp_path / "run"), "--quiet"]
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in names:
        assert n in err, err


@pytest.mark.parametrize("rank", [0, 2])
def test_the_train_view_has_the_views_values_and_float32_gradients(rank):
    """The loss differentiates `train_view`: `view`'s values, float32 arrays for the trained
    weights, and a gradient that reaches the masters (or adapters) unrounded."""
    spec = _spec(param_dtype="bfloat16")
    plan = (
        _plan(rank=rank, targets=("q", "v"), param_dtype="bfloat16")
        if rank
        else ParamFormat(param_dtype="bfloat16", precision="fp32_master")
    )
    _, state = _state(spec, plan)
    view, tv = plan.view(state), plan.train_view(state)
    for k in view:
        np.testing.assert_array_equal(
            np.asarray(tv[k], np.float32), np.asarray(view[k], np.float32)
        )
    assert tv["q"].dtype == jnp.float32 and view["q"].dtype == jnp.bfloat16
    # A cotangent that bfloat16 cannot hold (1 + 2^-12) reaches q's master exactly.
    c = 1.0 + 2.0**-12
    grads = jax.grad(lambda s: jnp.sum(plan.train_view(s)["q"]) * c)(state)
    if rank:
        # d/dB sum(W + s A B) = s x (the column sums of A), for every output column.
        a = np.asarray(state[LORA_KEY]["q"]["a"], np.float32)
        want = c * plan.lora_scale * np.sum(a, axis=-2)  # [..., r]
        got = np.asarray(grads[LORA_KEY]["q"]["b"], np.float32)
        np.testing.assert_allclose(got, np.broadcast_to(want[..., None], got.shape), rtol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(grads["q"]), np.full(state["q"].shape, c))
