"""One step's M updates as one jitted `lax.scan` (make_update) equal M separate calls of
the single-minibatch step (make_train_step) on the same minibatches."""

import jax
import numpy as np
import optax
import pytest

from rl_jax.config import LossConfig, ModelConfig
from rl_jax.models import init_params, resolve_spec
from rl_jax.sharding import get_rules
from rl_jax.train.step import (
    assemble_batch,
    make_train_step,
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
    return spec, tx, make_train_step(**kw), make_update(**kw)


def test_put_minibatches_stacks_prompt_groups_with_renumbered_ids():
    host = _host()
    mb = put_minibatches(host, None, num_minibatches=M, groups=P)
    assert mb.tokens.shape == (M, P * G // M, TP + TG)
    assert mb.group_size == G
    np.testing.assert_array_equal(mb.group_ids, [[0, 0, 1, 1], [0, 0, 1, 1]])
    np.testing.assert_array_equal(mb.tokens[1], host["tokens"][P * G // M :])


def test_scanned_update_equals_one_call_per_minibatch(setup):
    spec, tx, step, update = setup
    host = _host()
    params = init_params(spec, jax.random.key(1))
    rows = P * G // M
    p1, o1, per_call = params, tx.init(params), []
    for j in range(M):
        mb = {k: v[j * rows : (j + 1) * rows] for k, v in host.items()}
        mb["group_ids"] = mb["group_ids"] - j * (P // M)
        p1, o1, m = step(jax.tree.map(np.copy, p1), o1, put_batch(mb, None))
        per_call.append(m)
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
