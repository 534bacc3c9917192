"""bfloat16 models train on float32 master weights and moments (train.precision).

The reference for every comparison is a float32 run from the same (bfloat16-rounded)
initial weights on the same batch.
"""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl_jax.config import LossConfig, ModelConfig, load_recipe
from rl_jax.models import init_params, resolve_spec
from rl_jax.runs import read_jsonl
from rl_jax.sharding import get_rules
from rl_jax.train.loop import RLTrainer
from rl_jax.train.params import ParamFormat
from rl_jax.train.step import assemble_batch, make_update, put_minibatches

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

ROWS, TP, TG = 8, 6, 6


def _spec(param_dtype, compute_dtype):
    return resolve_spec(
        ModelConfig(
            preset="tiny",
            num_layers=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=4,
            num_kv_heads=2,
            param_dtype=param_dtype,
            compute_dtype=compute_dtype,
        )
    )


def _batch():
    rng = np.random.default_rng(0)
    host = assemble_batch(
        rng.integers(1, 60, (ROWS, TP)).astype(np.int32),
        np.ones((ROWS, TP), bool),
        rng.integers(1, 60, (ROWS, TG)).astype(np.int32),
        np.full((ROWS,), TG, np.int32),
        np.ones((ROWS, TG), np.float32),
        np.full((ROWS, TG), -3.0, np.float32),
        rng.standard_normal(ROWS).astype(np.float32),
        np.repeat(np.arange(2, dtype=np.int32), ROWS // 2),
    )
    return put_minibatches(host, None, num_minibatches=1, groups=2)


# The optimizers of these tests, by name, so that runs can be cached across tests.
_TX = {"sgd": lambda: optax.sgd(1e-4), "adamw": lambda: optax.adamw(1e-6)}


@functools.cache
def _run(param_dtype, compute_dtype, precision, tx_name, steps=3):
    """The weights' change after each of `steps` updates (as float32), and the final state
    and optimizer state. Cached: several tests compare the same runs."""
    spec = _spec(param_dtype, compute_dtype)
    tx = _TX[tx_name]()
    # Every run starts from the same weights: the init rounded to bfloat16.
    w0 = init_params(_spec("bfloat16", "float32"), jax.random.key(0))
    plan = ParamFormat(param_dtype=param_dtype, precision=precision)
    state = plan.init_state({k: v.astype(param_dtype) for k, v in w0.items()}, key=None, mesh=None)
    start = {k: np.asarray(v, np.float32) for k, v in state.items()}
    opt = plan.init_optimizer(tx, state)
    step = make_update(
        spec,
        get_rules("fsdp", purpose="train"),
        None,
        tx,
        LossConfig(name="grpo", advantage="grpo", kl_coef=0.0),
        num_groups=2,
        max_tokens=TG,
        temperature=1.0,
        plan=plan,
    )
    batch = _batch()
    deltas = []
    for _ in range(steps):
        state, opt, m = step(state, opt, batch)
        assert float(m["nonfinite"][0]) == 0
        deltas.append({k: np.asarray(v, np.float32) - start[k] for k, v in state.items()})
    return deltas, state, opt


def _deltas(param_dtype, compute_dtype, precision, *, tx, steps=3):
    """(the weights' change after `steps` updates, as float32; the state and optimizer
    state after all of the cached run's updates)."""
    deltas, state, opt = _run(param_dtype, compute_dtype, precision, tx)
    return deltas[steps - 1], state, opt


def _rel_diff(d, ref):
    num = sum(float(np.sum((d[k] - ref[k]) ** 2)) for k in ref)
    return np.sqrt(num / sum(float(np.sum(ref[k] ** 2)) for k in ref))


def _changed(d):
    return sum(int(np.sum(d[k] != 0)) for k in d) / sum(d[k].size for k in d)


def test_bf16_compute_on_float32_masters_updates_as_float32_does():
    """SGD (an update linear in the gradient): bf16 compute on float32 masters moves the
    weights as a float32 run does, up to bf16's activation noise (measured 0.50% after 3
    steps; 0.51% before gradients were added in float32)."""
    tx = "sgd"
    ref, _, _ = _deltas("float32", "float32", "fp32_master", tx=tx)
    master, state, _ = _deltas("bfloat16", "bfloat16", "fp32_master", tx=tx)
    assert all(v.dtype == jnp.float32 for v in state.values())
    print(
        "fp32_master, bf16 compute vs float32: relative update difference", _rel_diff(master, ref)
    )
    assert _rel_diff(master, ref) < 0.006


def test_bf16_weights_with_float32_compute_get_the_float32_gradient():
    """A bfloat16 view of float32 masters, computed in float32: the first update is the
    float32 run's exactly. The gradient of each weight's uses (prompt and completion
    streams, tied embedding and head) is added in float32 (ParamFormat.train_view); added
    in bfloat16 it was 0.25% off, with signs flipped where the uses cancel (an Adam update
    2.2% off). Later updates differ by the bfloat16 view, which cannot hold the masters'
    1e-6 steps (measured 0.80% and 1.17% at steps 2 and 3)."""
    tx = "adamw"
    ref, _, _ = _deltas("float32", "float32", "fp32_master", tx=tx, steps=1)
    got, _, _ = _deltas("bfloat16", "float32", "fp32_master", tx=tx, steps=1)
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def test_adam_updates_under_bf16_compute_differ_only_where_gradients_vanish():
    """Adam's first steps are ~lr x sign(gradient): bf16 compute's activation noise (0.5%
    of the gradient) flips the sign of the 0.24% of elements whose gradients are below
    it, and each flip moves an element by 2 lr: 8.3% of the update vector after 3 steps
    (float32 runs with the rows of each group permuted: 1e-5). Weighted by the float32
    gradient, what the loss sees of an update, the difference is 0.02%."""
    tx = "adamw"
    # The gradient, up to scale (what the weighting below is invariant to): the
    # first SGD step of the float32 run.
    g, _, _ = _deltas("float32", "float32", "fp32_master", tx="sgd", steps=1)
    ref, _, _ = _deltas("float32", "float32", "fp32_master", tx=tx)
    got, _, _ = _deltas("bfloat16", "bfloat16", "fp32_master", tx=tx)
    weighted = _rel_diff({k: g[k] * got[k] for k in g}, {k: g[k] * ref[k] for k in g})
    print("adam, bf16 compute vs float32: update", _rel_diff(got, ref), "weighted", weighted)
    assert _rel_diff(got, ref) < 0.09
    assert weighted < 0.001


def test_small_adam_steps_survive_in_masters_and_vanish_in_bf16_weights():
    """lr 1e-6 moves a 0.02 weight by ~2^-14 of itself, below half a bfloat16 bit: rounded
    into bf16 weights (pure, or fp32_moments) almost every update is lost; float32
    masters keep them all."""
    tx = "adamw"
    master, state, opt = _deltas("bfloat16", "bfloat16", "fp32_master", tx=tx)
    assert all(v.dtype == jnp.float32 for v in state.values())
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(opt) if m.ndim)
    print("weights changed: fp32_master", _changed(master))
    assert _changed(master) > 0.99
    for precision, moments in (("pure", jnp.bfloat16), ("fp32_moments", jnp.float32)):
        d, state, opt = _deltas("bfloat16", "bfloat16", precision, tx=tx)
        assert all(v.dtype == jnp.bfloat16 for v in state.values()), precision
        leaves = [m for m in jax.tree.leaves(opt) if m.ndim]
        assert leaves and all(m.dtype == moments for m in leaves), precision
        print(f"weights changed: {precision}", _changed(d))
        assert _changed(d) < 0.05, precision


# ---- a bfloat16 run end to end ---------------------------------------------------------------

BF16_RUN = [
    *train_even_first.TINY_RUN,
    "model.param_dtype=bfloat16",
    "model.compute_dtype=bfloat16",
    "model.fp32_lm_head=true",
    "train.lr=3e-3",
    "train.warmup_steps=0",
    "train.steps=10",
    "eval.every=0",
    "eval.at_start=false",
]


def test_a_bf16_run_on_float32_masters_learns_on_policy(tmp_path):
    cfg = load_recipe("scalerl", [*BF16_RUN, f"out_dir={tmp_path}", "name=bf16"])
    tr = RLTrainer(cfg, quiet=True)
    assert tr.parts.param_format.precision == "fp32_master"
    assert all(v.dtype == jnp.float32 for v in tr.params.values())
    sampled = [tr.sampler_weights()[0]]
    tr.step_hooks.append(lambda t: sampled.append(t.sampler_weights()[0]))
    tr.run_loop()
    # The sampler runs the bfloat16 copy of the masters, the loss the same copy.
    assert all(v.dtype == jnp.bfloat16 for v in sampled[-1].values())
    view = tr.parts.param_format.view(tr.params)
    for k in view:
        np.testing.assert_array_equal(np.asarray(sampled[-1][k]), np.asarray(view[k]), err_msg=k)
    # P(even first digit), what the verifier rewards (measured: 0.0781, then 0.0882 ..
    # 0.1075, 0.0987 after 10 steps, gradients added in float32).
    mass = [train_even_first.even_first_mass(tr, w) for w in sampled]
    print("bf16: P(even first digit) by step", np.round(mass, 4).tolist())
    assert mass[-1] > mass[0] + 0.01, mass
    assert np.mean(mass[-3:]) > np.mean(mass[:3]), mass
    rows = read_jsonl(tmp_path / "bf16" / "metrics.jsonl")
    ratios = [r[k] for r in rows for k in ("train/ratio_max", "train/ratio_min") if k in r]
    # On CPU measured within 1.1e-3 of 1; bf16's tolerance is 1e-2.
    print("bf16 on-policy ratios", min(ratios), max(ratios))
    assert ratios and np.allclose(ratios, 1.0, atol=1e-2), ratios
    # The run's checkpoint holds the float32 masters; as a model it is their bf16 copy.
    from rl_jax.models import model_params
    from rl_jax.train.policy_io import load_run_model

    model, _ = load_run_model(tmp_path / "bf16")
    loaded = model_params(model)
    for k in view:
        assert loaded[k].dtype == jnp.bfloat16, k
        np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(view[k]), err_msg=k)
