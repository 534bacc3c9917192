"""One step's M updates as one jitted `lax.scan` (make_update) equal M separate calls of
the update on one minibatch each, with or without a ParamFormat (float32 masters,
LoRA)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rl_jax.config import LossConfig, ModelConfig
from rl_jax.models import init_params, resolve_spec
from rl_jax.sharding import get_rules
from rl_jax.train.params import LORA_KEY, ParamFormat
from rl_jax.train.step import (
    assemble_batch,
    make_logprob_fn,
    make_update,
    put_batch,
    put_minibatches,
)

P, G, M, TP, TG = 4, 2, 2, 5, 4


def _host(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    B = P * G
    prompts = np.repeat(rng.integers(1, 20, (P, TP)), G, axis=0).astype(np.int32)
    host = assemble_batch(
        prompts,
        np.ones((B, TP), bool),
        rng.integers(1, 20, (B, TG)).astype(np.int32),
        np.full(B, TG, np.int32),
        np.ones((B, TG), np.float32),
        rng.normal(-2.0, 0.3, (B, TG)).astype(np.float32),
        rng.normal(0.0, 1.0, B).astype(np.float32),
        np.repeat(np.arange(P, dtype=np.int32), G),
    )
    host["old_logp"] = rng.normal(-2.0, 0.3, (B, TG)).astype(np.float32)
    return host


@pytest.fixture(scope="module")
def setup():
    spec = resolve_spec(
        ModelConfig(preset="tiny", num_layers=2, hidden_size=32, intermediate_size=48)
    )
    tx = optax.adamw(1e-2)
    kw = dict(
        spec=spec,
        rules=get_rules("fsdp", purpose="train"),
        mesh=None,
        tx=tx,
        loss_cfg=LossConfig(name="grpo", advantage="grpo", kl_coef=0.0),
        num_groups=P // M,
        max_tokens=TG,
        temperature=1.0,
    )
    return spec, tx, make_update(**kw)


def test_put_minibatches_stacks_prompt_groups_with_renumbered_ids():
    host = _host()
    mb = put_minibatches(host, None, num_minibatches=M, groups=P)
    assert mb.tokens.shape == (M, P * G // M, TP + TG)
    assert mb.group_size == G
    np.testing.assert_array_equal(mb.group_ids, [[0, 0, 1, 1], [0, 0, 1, 1]])
    np.testing.assert_array_equal(mb.tokens[1], host["tokens"][P * G // M :])


@pytest.mark.parametrize("on_mesh", [False, True], ids=["no-mesh", "8-devices"])
def test_logprob_pass_over_stacked_minibatches_equals_the_whole_batch(setup, on_mesh):
    """The trainer's old/reference log-prob pass takes the update's M minibatches one
    after another (phases.advantages); row for row it is the whole batch's pass."""
    if on_mesh and jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    from rl_jax.config import MeshConfig
    from rl_jax.sharding import make_mesh

    spec = setup[0]
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)) if on_mesh else None
    rules = get_rules("fsdp_tp", purpose="train")
    fn = make_logprob_fn(spec, rules, mesh, temperature=0.7)
    host = _host(seed=3)
    params = init_params(spec, jax.random.key(2))
    whole = np.asarray(fn(params, put_batch(host, mesh)))
    for m in (1, M):
        stacked = np.asarray(fn(params, put_minibatches(host, mesh, num_minibatches=m, groups=P)))
        assert stacked.shape == (m, P * G // m, TG)
        np.testing.assert_allclose(stacked.reshape(P * G, TG), whole, rtol=1e-5, atol=1e-6)


def test_scanned_update_equals_one_call_per_minibatch(setup):
    spec, tx, update = setup
    host = _host()
    params = init_params(spec, jax.random.key(1))
    rows = P * G // M
    p1, o1, per_call = params, tx.init(params), []
    for j in range(M):
        mb = {k: v[j * rows : (j + 1) * rows] for k, v in host.items()}
        mb["group_ids"] = mb["group_ids"] - j * (P // M)
        one = put_minibatches(mb, None, num_minibatches=1, groups=P // M)
        p1, o1, m = update(jax.tree.map(np.copy, p1), o1, one)
        per_call.append({k: v[0] for k, v in m.items()})
    batches = put_minibatches(host, None, num_minibatches=M, groups=P)
    p2, o2, scanned = update(init_params(spec, jax.random.key(1)), tx.init(params), batches)
    for k in per_call[0]:
        np.testing.assert_allclose(
            np.asarray(scanned[k]), [float(m[k]) for m in per_call], rtol=1e-6, atol=1e-7
        )
    for k in p1:
        np.testing.assert_allclose(np.asarray(p2[k]), np.asarray(p1[k]), rtol=1e-6, atol=1e-7)
    # The second update saw the first one's weights: the params moved twice.
    assert int(o2[0].count) == M


def test_scanned_update_trains_the_plans_state_as_the_single_step_does(setup):
    """With float32 masters of a bfloat16 model and LoRA adapters (rl_jax.train.params),
    the scanned update differentiates through the plan's view and updates only the
    trained part, exactly as M calls of it on one minibatch each with the same plan."""
    spec, _, _ = setup
    spec = dataclasses.replace(spec, param_dtype="bfloat16")
    plan = ParamFormat(
        param_dtype="bfloat16",
        precision="fp32_master",
        lora_rank=2,
        lora_scale=4.0,
        lora_targets=("q", "v", "down"),
    )
    tx = optax.adamw(1e-2)
    kw = dict(
        spec=spec,
        rules=get_rules("fsdp", purpose="train"),
        mesh=None,
        tx=tx,
        loss_cfg=LossConfig(name="grpo", advantage="grpo", kl_coef=0.0),
        num_groups=P // M,
        max_tokens=TG,
        temperature=1.0,
        plan=plan,
    )
    update = make_update(**kw)

    def fresh():
        weights = init_params(spec, jax.random.key(1))
        return plan.init_state(weights, key=jax.random.key(2), mesh=None)

    host, rows = _host(), P * G // M
    s1 = fresh()
    o1 = plan.init_optimizer(tx, s1)
    for j in range(M):
        mb = {k: v[j * rows : (j + 1) * rows] for k, v in host.items()}
        mb["group_ids"] = mb["group_ids"] - j * (P // M)
        one = put_minibatches(mb, None, num_minibatches=1, groups=P // M)
        s1, o1, _ = update(jax.tree.map(jnp.copy, s1), o1, one)
    start = fresh()
    batches = put_minibatches(host, None, num_minibatches=M, groups=P)
    s2, _, m = update(fresh(), plan.init_optimizer(tx, start), batches)
    assert not np.any(np.asarray(m["nonfinite"]))
    flat1, flat2 = jax.tree_util.tree_leaves_with_path(s1), jax.tree.leaves(s2)
    for (path, a), b in zip(flat1, flat2, strict=True):
        assert a.dtype == b.dtype, path
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    # The base stays as it was, the adapters (float32) moved: B starts at zero.
    for k, v in start.items():
        if k != LORA_KEY:
            np.testing.assert_array_equal(np.asarray(s2[k]), np.asarray(v), err_msg=k)
    assert s2[LORA_KEY]["q"]["b"].dtype == jnp.float32
    assert float(jnp.abs(s2[LORA_KEY]["q"]["b"]).max()) > 0


@pytest.mark.parametrize("attention", ["blockwise", "dense"])
def test_training_forward_is_the_same_with_blockwise_attention(setup, attention):
    """The trainer's shared-prefix forward (prompt once per group, left-padded prompts)
    gives the dense form's log-probs, entropies and gradients with model.attention=
    blockwise (blocks of 3 keys, not dividing the prompt's 5 nor the 8 of a row)."""
    from rl_jax.train.step import completion_logprobs

    spec = setup[0]
    host = _host(1)
    host["valid"][np.repeat(np.arange(P) % 2 == 0, G), :2] = False  # groups 0, 2: left pads
    host["positions"] = np.maximum(np.cumsum(host["valid"], axis=1, dtype=np.int32) - 1, 0)
    batch = put_batch(host, None)
    assert batch.group_size == G
    params = init_params(spec, jax.random.key(3))
    rules = get_rules("fsdp", purpose="train")

    def run(s):
        def loss(p):
            logp, ent = completion_logprobs(s, rules, None, p, batch, 1.0)
            return jnp.sum(logp * batch.mask) + 0.1 * jnp.sum(ent * batch.mask), (logp, ent)

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (l0, (lp0, e0)), g0 = run(spec.replace(attention="dense"))
    (l1, (lp1, e1)), g1 = run(spec.replace(attention=attention, attention_block=3))
    np.testing.assert_allclose(lp1, lp0, atol=1e-5)
    np.testing.assert_allclose(e1, e0, atol=1e-5)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_micro_batches_under_grad_accum_take_the_whole_batchs_step():
    """What `rl-jax plan --search` relies on: M micro-batches with train.grad_accum = M
    take the one optimizer step the whole batch takes (prompt-level aggregation: the
    micro-batches' mean of per-prompt means is the batch's), with no old policy's
    log-probs (`accounting.policy_steps` is 1: ratios against the sampler's, as the
    batch's own)."""
    spec = resolve_spec(
        ModelConfig(preset="tiny", num_layers=2, hidden_size=32, intermediate_size=48)
    )
    loss = LossConfig(name="cispo", advantage="grpo", kl_coef=0.0, aggregation="prompt")
    host = _host(seed=5)
    del host["old_logp"]
    params = init_params(spec, jax.random.key(4))
    out = {}
    for m in (1, M):
        tx = optax.MultiSteps(optax.sgd(0.5), every_k_schedule=m) if m > 1 else optax.sgd(0.5)
        kw = dict(spec=spec, rules=get_rules("fsdp", purpose="train"), mesh=None, tx=tx)
        update = make_update(**kw, loss_cfg=loss, num_groups=P // m, max_tokens=TG, temperature=1.0)
        batches = put_minibatches(host, None, num_minibatches=m, groups=P)
        start = jax.tree.map(jnp.copy, params)
        out[m], _, _ = update(start, tx.init(start), batches)
    moved = 0.0
    for k in params:
        np.testing.assert_allclose(np.asarray(out[M][k]), np.asarray(out[1][k]), atol=1e-6)
        moved = max(moved, float(np.abs(np.asarray(out[1][k]) - np.asarray(params[k])).max()))
    assert moved > 1e-3  # the step moved the weights
