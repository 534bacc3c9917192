"""Mixture-of-experts decoders (Qwen3-MoE): the sparse MLP against a per-token reference,
its dispatch (no dense [tokens, experts, ...] arrays), the engine's decode step against
the trainer's forward, specs, presets and FLOPs, router losses and metrics."""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import _sequences

from rl_jax.config import ModelConfig, SamplingConfig
from rl_jax.knobs import ConfigError
from rl_jax.models import (
    Transformer,
    init_params,
    positions_from_valid,
    resolve_spec,
    token_logprobs,
)
from rl_jax.models.moe import RouterStats, aux_losses, moe_mlp, route
from rl_jax.sampling import Engine

SPEC = resolve_spec(
    ModelConfig(
        preset="tiny-moe",
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        moe_intermediate_size=48,
    )
)
PROMPTS = [[3, 9, 4], [7, 1, 8, 2, 6, 5, 11], [12, 13, 14, 15, 16]]


def _params(seed, spec=SPEC, scale=3.0):
    """Random weights scaled up, so logits and router choices are far from ties."""
    p = init_params(spec, jax.random.key(seed))
    norms = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm")
    return {k: v if k in norms else v * scale for k, v in p.items()}


def _reference_moe(h, router, wg, wu, wd, *, top_k, norm_topk_prob, experts=None):
    """Token by token, as transformers' Qwen3MoeSparseMoeBlock reads: softmax over all
    experts, top k (or `experts` [N, k] given: routing replay), renormalized or not,
    SwiGLU of each chosen expert, weighted sum."""
    h, router = np.asarray(h, np.float64), np.asarray(router, np.float64)
    wg, wu, wd = (np.asarray(w, np.float64) for w in (wg, wu, wd))
    out = np.zeros_like(h)
    for n, x in enumerate(h):
        z = x @ router
        p = np.exp(z - z.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:top_k] if experts is None else experts[n]
        w = p[top] / (p[top].sum() if norm_topk_prob else 1.0)
        for e, we in zip(top, w, strict=True):
            g, u = x @ wg[e], x @ wu[e]
            out[n] += we * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return out


@pytest.mark.parametrize("E,k,norm", [(4, 1, False), (8, 2, True), (8, 3, False)])
def test_sparse_mlp_equals_the_per_token_reference(E, k, norm):
    keys = jax.random.split(jax.random.key(E * 10 + k), 5)
    N, D, F = 13, 16, 24
    h = jax.random.normal(keys[0], (N, D))
    router = jax.random.normal(keys[1], (D, E))
    wg, wu = (jax.random.normal(kk, (E, D, F)) * 0.3 for kk in keys[2:4])
    wd = jax.random.normal(keys[4], (E, F, D)) * 0.3
    mlp = jax.jit(functools.partial(moe_mlp, top_k=k, norm_topk_prob=norm))
    out, stats, chosen = mlp(h, router, wg, wu, wd)
    want = _reference_moe(h, router, wg, wu, wd, top_k=k, norm_topk_prob=norm)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    # Statistics: every token counted once, k assignments each.
    assert float(stats.tokens) == N and float(stats.load.sum()) == N * k
    np.testing.assert_allclose(float(stats.prob.sum()), N, rtol=1e-5)
    # Routing replay: its own choice gives the same output; other experts (the next k
    # of each token's ranking) give the reference's output with those experts, weighted
    # by this router's probabilities of them.
    again, _, same = mlp(h, router, wg, wu, wd, experts=chosen)
    np.testing.assert_array_equal(same, chosen)
    np.testing.assert_allclose(again, out, rtol=1e-6, atol=1e-6)
    ranked = np.argsort(-np.asarray(h @ router), axis=1, kind="stable")
    others = np.roll(ranked, -1, axis=1)[:, :k].astype(np.uint8)  # a recorded dtype
    replayed, stats, used = mlp(h, router, wg, wu, wd, experts=others)
    np.testing.assert_array_equal(used, others)
    want = _reference_moe(h, router, wg, wu, wd, top_k=k, norm_topk_prob=norm, experts=others)
    np.testing.assert_allclose(replayed, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(replayed, out, atol=1e-3)
    np.testing.assert_array_equal(stats.load, np.bincount(others.ravel(), minlength=E))


def test_dispatch_builds_nothing_of_tokens_by_experts_by_width():
    """The training forward's dispatch is a sort and gathers: on TPU, where ragged_dot is
    one grouped matmul, no array of the program has [N, E, ...] or [E, N, ...] shape
    (XLA:CPU's own lowering of ragged_dot masks per group, so the program is checked
    before lowering, as jaxpr)."""
    N, D, E, F, k = 64, 16, 8, 24, 2
    args = (
        jnp.zeros((N, D)),
        jnp.zeros((D, E)),
        jnp.zeros((E, D, F)),
        jnp.zeros((E, D, F)),
        jnp.zeros((E, F, D)),
    )

    def loss(*a):
        out, _, _ = moe_mlp(*a, top_k=k, norm_topk_prob=True)
        return jnp.sum(out)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    shapes = set()

    def walk(jx):
        for eqn in jx.eqns:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
            for sub in jax.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert (N * k, F) in shapes  # the grouped matmuls' rows: one per assignment
    assert not [s for s in shapes if len(s) >= 3 and N in s and E in s], shapes


def test_router_renormalizes_only_when_asked():
    x = jax.random.normal(jax.random.key(0), (5, 8))
    r = jax.random.normal(jax.random.key(1), (8, 6))
    _, e1, w1 = route(x, r, top_k=2, norm_topk_prob=False)
    _, e2, w2 = route(x, r, top_k=2, norm_topk_prob=True)
    np.testing.assert_array_equal(e1, e2)
    assert (np.asarray(w1.sum(-1)) < 1).all()
    np.testing.assert_allclose(w2.sum(-1), 1.0, rtol=1e-6)


def test_aux_losses_by_hand():
    """Two layers, E = 2, k = 1: uniform routing gives load balance 1; one expert taking
    every token with probability 0.9 gives E x (1 x 0.9) = 1.8."""
    stats = RouterStats(
        tokens=jnp.array([4.0, 4.0]),
        load=jnp.array([[2.0, 2.0], [4.0, 0.0]]),
        prob=jnp.array([[2.0, 2.0], [3.6, 0.4]]),
        z=jnp.array([8.0, 16.0]),
        entropy=jnp.array([4.0, 2.0]),
    )
    out = aux_losses(stats, num_experts=2, top_k=1)
    np.testing.assert_allclose(out["load_balance"], (1.0 + 1.8) / 2, rtol=1e-6)
    np.testing.assert_allclose(out["z"], (2.0 + 4.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(out["load"], [6 / 8, 2 / 8], rtol=1e-6)
    np.testing.assert_allclose(out["entropy"], (1.0 + 0.5) / 2, rtol=1e-6)


# ---- specs, presets, FLOPs ---------------------------------------------------------------


def test_published_presets_count_their_parameters():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active; Qwen3-235B-A22B: 235B, 22B (the
    model cards' numbers)."""
    a3b = resolve_spec(ModelConfig(preset="qwen3-30b-a3b"))
    a22b = resolve_spec(ModelConfig(preset="qwen3-235b-a22b"))
    assert a3b.num_params() / 1e9 == pytest.approx(30.5, abs=0.1)
    assert a22b.num_params() / 1e9 == pytest.approx(235.1, abs=0.3)
    active = (a3b.flops_per_token(0) / 2 + a3b.vocab_size * a3b.hidden_size) / 1e9
    assert 3.3 <= active < 3.4  # "3.3B activated", the embedding counted
    # Qwen2-MoE, a shared expert beside the routed ones: Qwen1.5-MoE-A2.7B 14.3B, 2.7B
    # active; Qwen2-57B-A14B 57.4B, 14B active (the model cards').
    for name, total, act in (("qwen1.5-moe-a2.7b", 14.3, 2.7), ("qwen2-57b-a14b", 57.4, 14.2)):
        spec = resolve_spec(ModelConfig(preset=name))
        assert spec.num_params() / 1e9 == pytest.approx(total, abs=0.05)
        active = (spec.flops_per_token(0) / 2 + spec.vocab_size * spec.hidden_size) / 1e9
        assert active == pytest.approx(act, abs=0.05)
    # A dense spec's accounting is untouched by the new fields.
    dense = resolve_spec(ModelConfig(preset="qwen3-8b"))
    assert not dense.is_moe and dense.num_params() / 1e9 == pytest.approx(8.19, abs=0.01)


def test_expert_knobs_override_a_dense_preset_and_bad_ones_are_refused():
    spec = resolve_spec(
        ModelConfig(preset="tiny", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)
    )
    assert spec.is_moe and spec.architecture == "qwen2" and not spec.norm_topk_prob
    plain = resolve_spec(ModelConfig(preset="tiny-moe", norm_topk_prob="false"))
    assert plain.norm_topk_prob is False
    with pytest.raises(ConfigError, match="model.moe_intermediate_size=0"):
        resolve_spec(ModelConfig(preset="tiny", num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ConfigError, match=r"model.num_experts_per_tok=5 must be in \[1"):
        resolve_spec(ModelConfig(preset="tiny-moe", num_experts_per_tok=5))
    with pytest.raises(ConfigError, match="model.norm_topk_prob"):
        ModelConfig(norm_topk_prob="maybe")
    shared = resolve_spec(ModelConfig(preset="tiny-moe", shared_expert_intermediate_size=32))
    assert shared.shared_expert_intermediate_size == 32
    # Its weights: 3 x D x Fs and the gate's D a layer, all active.
    extra = shared.num_layers * (3 * shared.hidden_size * 32 + shared.hidden_size)
    assert shared.num_params() - resolve_spec(ModelConfig(preset="tiny-moe")).num_params() == extra
    with pytest.raises(ConfigError, match="model.shared_expert_intermediate_size=32 needs"):
        resolve_spec(ModelConfig(preset="tiny", shared_expert_intermediate_size=32))


# ---- the forward, the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    return _params(0)


@jax.jit
def _trainer_logprobs(params, tokens, valid, positions):
    model = Transformer(SPEC, params)
    return token_logprobs(model, tokens, positions, kv_valid_bt=valid)[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_decodes_the_sparse_mlp_as_the_trainer_scores_it(params, temperature):
    """The engine's decode step (a paged cache, three slots for six rows) and the
    trainer's full forward give each sampled token the same log-prob."""
    cfg = SamplingConfig(
        temperature=temperature, max_new_tokens=10, length_bucket=8, max_prompt_len=16
    )
    engine = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0)
    out, _ = engine.run(params, PROMPTS, n=2, seed=3)
    # A slot for every row, decoded in one call: the same tokens.
    whole = Engine.for_batch(SPEC, cfg, prompts=len(PROMPTS), n=2, prompt_len=16, pad_id=0)
    ref, _ = whole.run(params, PROMPTS, n=2, seed=3)
    np.testing.assert_array_equal(out.completion_tokens, ref.completion_tokens)
    logp = np.asarray(_trainer_logprobs(params, *_sequences(out)))
    tp = out.prompt_tokens.shape[1]
    m = out.completion_mask
    np.testing.assert_allclose(out.logprobs[m], logp[:, tp - 1 : -1][m], atol=1e-4)


def test_engine_decodes_a_shared_expert_as_the_trainer_scores_it():
    """With a shared expert (Qwen2-MoE) beside the routed ones: the engine's decode step
    and the trainer's forward give each sampled token the same log-prob, and the shared
    expert is in both (the tokens differ without it)."""
    spec = dataclasses.replace(SPEC, shared_expert_intermediate_size=32)
    params = _params(1, spec)
    assert params["shared_gate"].shape == (2, 64, 32)
    assert params["shared_expert_gate"].shape == (2, 64)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, length_bucket=8, max_prompt_len=16)
    engine = Engine(spec, cfg, slots=3, chunk=4, pad_id=0)
    out, _ = engine.run(params, PROMPTS, n=1, seed=3)
    model = Transformer(spec, params)
    seqs = _sequences(out)
    logp = np.asarray(
        jax.jit(lambda *a: token_logprobs(model, a[0], a[2], kv_valid_bt=a[1])[0])(*seqs)
    )
    tp, m = out.prompt_tokens.shape[1], out.completion_mask
    np.testing.assert_allclose(out.logprobs[m], logp[:, tp - 1 : -1][m], atol=1e-4)
    without = {k: v for k, v in params.items() if not k.startswith("shared")}
    plain = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0).run(without, PROMPTS, n=1, seed=3)[0]
    assert not np.array_equal(plain.completion_tokens, out.completion_tokens)


def _replay_logprobs(spec, params, out, routes):
    """The trainer's log-probs of a Rollouts' completions (its step's forward), routing
    each token as `routes` says (None: its own router's top k)."""
    from rl_jax.sharding import get_rules
    from rl_jax.train.step import compiler_options, completion_forward, put_batch, rollout_arrays

    out = dataclasses.replace(out, routes=routes)
    host = rollout_arrays(out, out.completion_mask, np.zeros(out.num_rows))
    rules = get_rules("fsdp_tp")
    fwd = jax.jit(
        lambda p, b: completion_forward(spec, rules, None, p, b, 1.0)[0],
        compiler_options=compiler_options(None, spec),  # the trainer's
    )
    return np.asarray(fwd(params, put_batch(host, None)))


def _fed(out) -> np.ndarray:
    """[B, Tp + Tg] the tokens a sampler fed through the model: the prompt's and the
    completion's but its last."""
    tp, tg = out.prompt_tokens.shape[1], out.completion_tokens.shape[1]
    fed = np.concatenate([out.prompt_mask, np.arange(tg) < out.lengths[:, None] - 1], axis=1)
    fed[:, tp - 1] = True
    return fed


@pytest.mark.devices(8)
def test_expert_parallel_sparse_mlp_equals_one_devices():
    """The decode step's sparse MLP on a data 2 x fsdp 2 x tensor 2 mesh, each device
    holding 4 of the 8 experts (half of each one's width): the tokens go to the experts
    and back, and every token's output and experts are one device's."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rl_jax.config import MeshConfig
    from rl_jax.models.moe import expert_parallel_moe_mlp
    from rl_jax.sharding import get_rules, make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = get_rules("fsdp_tp", purpose="sample")
    keys = jax.random.split(jax.random.key(3), 5)
    N, D, E, F, k = 12, 16, 8, 24, 3
    h = jax.random.normal(keys[0], (N, D))
    router = jax.random.normal(keys[1], (D, E))
    w = (*(jax.random.normal(kk, (E, D, F)) * 0.3 for kk in keys[2:4]),)
    w = (*w, jax.random.normal(keys[4], (E, F, D)) * 0.3)
    kw = dict(top_k=k, norm_topk_prob=True)
    want, _, chosen = jax.jit(lambda *a: moe_mlp(*a, **kw))(h, router, *w)
    placed = [
        jax.device_put(x, NamedSharding(mesh, spec))
        for x, spec in zip(
            (h, *w),
            (
                P(("data", "fsdp")),
                P("fsdp", None, "tensor"),
                P("fsdp", None, "tensor"),
                P("fsdp", "tensor"),
            ),
            strict=True,
        )
    ]
    ep = jax.jit(lambda h, r, *ws: expert_parallel_moe_mlp(mesh, rules, h, (r, *ws), **kw))
    got, experts = ep(placed[0], router, *placed[1:])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(experts, chosen)
    # Only this device's experts' share: moe_mlp of experts 4..7 alone, summed with 0..3.
    lo = jax.jit(lambda *a: moe_mlp(*a, **kw)[0])(h, router, *(x[:4] for x in w))
    hi = jax.jit(lambda *a: moe_mlp(*a, first=4, **kw)[0])(h, router, *(x[4:] for x in w))
    np.testing.assert_allclose(lo + hi, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(hi, want, atol=1e-3)


def test_the_engine_records_the_routes_the_trainer_replays(params):
    """`record_routes`: the experts of every token the engine fed (prompts in the prefill
    pool, completions step by step over chunks and refills) are the ones the trainer's
    full forward routes it to (float32: no rounding flips), in `Rollouts.routes`'
    columns; replaying them gives the trainer's log-probs unchanged. A dense model has
    nothing to record."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, length_bucket=8, max_prompt_len=16)
    engine = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0, record_routes=True)
    out, _ = engine.run(params, PROMPTS, n=2, seed=5)
    L, k = SPEC.num_layers, SPEC.num_experts_per_tok
    tp, tg = out.prompt_tokens.shape[1], out.completion_tokens.shape[1]
    assert out.routes.shape == (6, tp + tg, L, k) and out.routes.dtype == np.uint8
    tokens, valid, positions = _sequences(out)
    model = Transformer(SPEC, params)
    _, _, own = jax.jit(lambda *a: model(a[0], a[2], kv_valid_bs=a[1], record_routes=True))(
        tokens, valid, positions
    )
    fed = _fed(out)
    assert fed.sum() > 6 * tp // 2
    got, want = np.sort(out.routes, axis=-1), np.sort(np.asarray(own), axis=-1)
    np.testing.assert_array_equal(got[fed], want[fed])
    assert not out.routes[~fed].any()
    # Without a mixture of experts: refused. Without recording: no routes.
    plain, _ = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0).run(params, PROMPTS, n=2, seed=5)
    assert plain.routes is None
    np.testing.assert_array_equal(plain.completion_tokens, out.completion_tokens)
    m = out.completion_mask
    replayed = _replay_logprobs(SPEC, params, out, out.routes)
    np.testing.assert_allclose(replayed[m], _replay_logprobs(SPEC, params, out, None)[m], atol=1e-6)
    dense = SPEC.replace(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    with pytest.raises(ConfigError, match="no router"):
        Engine(dense, cfg, slots=3, record_routes=True)


def test_routing_replay_removes_the_mismatch_of_flipped_routes():
    """In bfloat16 the engine's decode and the trainer's forward round differently, and
    some near-tied router choices flip between them: replaying the sampler's routes
    brings the trainer's log-probs closer to the sampler's (docs/moe.md has the
    measurement beside a dense model's)."""
    spec = SPEC.replace(compute_dtype="bfloat16")
    params = init_params(spec, jax.random.key(3))  # not scaled: near ties (flips in 7 rows)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 64, rng.integers(4, 16))) for _ in range(8)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=32, length_bucket=8, max_prompt_len=16)
    engine = Engine(spec, cfg, slots=8, chunk=8, pad_id=0, record_routes=True)
    out, _ = engine.run(params, prompts, n=4, seed=1)
    tokens, valid, positions = _sequences(out)
    model = Transformer(spec, params)
    from rl_jax.train.step import compiler_options

    own = jax.jit(  # the experts the trainer's forward (its compiler options) routes to
        lambda *a: model(a[0], a[2], kv_valid_bs=a[1], record_routes=True)[2],
        compiler_options=compiler_options(None, spec),
    )(tokens, valid, positions)
    same = np.all(np.sort(out.routes, -1) == np.sort(np.asarray(own), -1), axis=-1)
    flipped = np.any(~same, axis=-1) & _fed(out)  # [B, T]: some layer routed otherwise
    rows = flipped.any(axis=1)
    assert 0 < rows.sum() < len(rows)
    without = np.abs(_replay_logprobs(spec, params, out, None) - out.logprobs)
    replay = np.abs(_replay_logprobs(spec, params, out, out.routes) - out.logprobs)
    m = out.completion_mask
    # Rows without a flip: replay routes as the trainer would; rows with one: closer.
    np.testing.assert_allclose(replay[m & ~rows[:, None]], without[m & ~rows[:, None]], atol=1e-6)
    assert replay[m & rows[:, None]].mean() < without[m & rows[:, None]].mean()
    assert replay[m].max() < without[m].max()


def test_exact_rounding_makes_the_sampler_and_the_trainer_round_alike():
    """bfloat16: by default XLA keeps some intermediates of a fusion in more precision
    than their dtype, differently in the engine's decode and in the trainer's forward:
    no token's log-prob comes out the same (mean gap ~4.5e-4 here). With
    `model.exact_rounding` both round every op as written: most tokens' log-probs are
    the same to the bit, for a dense model and for a mixture of experts whose routes
    are replayed (its experts' outputs mixed in float32: in bfloat16 the router's
    weights would round apart). docs/results/precision.md has the numbers."""
    bf = SPEC.replace(compute_dtype="bfloat16", exact_rounding=True)
    dense = bf.replace(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 64, rng.integers(4, 16))) for _ in range(6)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, length_bucket=8, max_prompt_len=16)
    for spec in (dense, bf):
        params = init_params(spec, jax.random.key(0))
        engine = Engine(spec, cfg, slots=8, chunk=8, pad_id=0, record_routes=spec.is_moe)
        out, _ = engine.run(params, prompts, n=4, seed=1)
        trainer = _replay_logprobs(spec, params, out, out.routes)
        gap = np.abs(trainer - out.logprobs)[out.completion_mask]
        assert (gap == 0).mean() > 0.5 and gap.mean() < 1e-4, ((gap == 0).mean(), gap.mean())


def test_shared_prefix_router_stats_count_valid_tokens_only(params):
    """The trainer's forward (each prompt once per group) reports the router over the
    valid tokens: pads change no statistic."""
    model = Transformer(SPEC, params)
    P, G, tp, tc = 2, 2, 5, 4
    rng = np.random.default_rng(0)
    pt = jnp.asarray(rng.integers(1, 64, (P, tp)))
    ct = jnp.asarray(rng.integers(1, 64, (P * G, tc)))
    pv = jnp.ones((P, tp), bool).at[0, :2].set(False)
    cv = jnp.ones((P * G, tc), bool).at[:, 3:].set(False)

    @jax.jit
    def stats(pt, ct):
        return model.shared_prefix(
            pt,
            positions_from_valid(pv),
            pv,
            ct,
            tp + jnp.zeros((P * G, tc), jnp.int32) + jnp.arange(tc),
            cv,
            group_size=G,
            with_router=True,
        )[2]

    s = stats(pt, ct)
    assert s.load.shape == (SPEC.num_layers, SPEC.num_experts)
    np.testing.assert_array_equal(s.tokens, [int(pv.sum() + cv.sum())] * SPEC.num_layers)
    # Changing pad tokens changes nothing the statistics count.
    s2 = stats(pt.at[0, :2].set(7), ct.at[:, 3:].set(9))
    for a, b in zip(s, s2, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ---- HF checkpoints: parity with transformers' Qwen3MoeForCausalLM -------------------------


def _hf_moe(tmp_path_factory, *, experts, top_k, norm, tie=False, shared=0, layers=2, **more):
    """A random Qwen3-MoE (`shared`: a Qwen2-MoE with a shared expert of that width) as
    transformers builds and saves it (weights scaled up, so the router's choices, the
    shared expert's gate and the norms matter); `more`: other config fields."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    family = transformers.Qwen2MoeConfig if shared else transformers.Qwen3MoeConfig
    cfg = family(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=24,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        **({"shared_expert_intermediate_size": shared} if shared else {"head_dim": 16}),
        **more,
    )
    torch.manual_seed(experts * 10 + top_k)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    d = tmp_path_factory.mktemp(f"moe_{experts}_{top_k}_{norm}_{shared}_{layers}")
    model.save_pretrained(d)
    return d, model


HF_TOKENS = np.random.default_rng(0).integers(0, 48, (2, 17))


def _hf_logprobs(model, toks=HF_TOKENS):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor(toks)).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1]
    return lp.gather(-1, torch.tensor(toks[:, 1:, None]))[..., 0].numpy()


def _same_logprobs_and_round_trip(ours, want, cls: str, tmp_path_factory) -> None:
    """`ours` gives transformers' log-probs `want` (1e-4), and its export loads in
    transformers as `cls` with the same log-probs."""
    import torch
    import transformers

    from rl_jax.models.hf import export_hf

    got = jax.jit(lambda t: token_logprobs(ours, t)[0][:, :-1])(jnp.asarray(HF_TOKENS))
    np.testing.assert_allclose(got, want, atol=1e-4)
    out = export_hf(ours, tmp_path_factory.mktemp("export"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back).__name__ == cls
    np.testing.assert_allclose(_hf_logprobs(back), want, atol=1e-4)


@pytest.mark.parity
@pytest.mark.parametrize(
    "experts,top_k,norm", [(4, 1, False), (4, 2, True), (8, 2, False), (8, 1, True)]
)
def test_qwen3_moe_loads_and_exports_with_transformers_logits(
    experts, top_k, norm, tmp_path_factory
):

    from rl_jax.models.hf import load_hf

    d, hf_model = _hf_moe(tmp_path_factory, experts=experts, top_k=top_k, norm=norm)
    want = _hf_logprobs(hf_model)
    ours = load_hf(d)
    spec = ours.spec
    assert (spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob) == (
        experts,
        top_k,
        norm,
    )
    _same_logprobs_and_round_trip(ours, want, "Qwen3MoeForCausalLM", tmp_path_factory)


@pytest.mark.parity
@pytest.mark.parametrize("experts,top_k,norm", [(4, 1, False), (8, 2, True), (16, 4, False)])
def test_qwen2_moe_with_a_shared_expert_loads_and_exports_with_transformers_logits(
    experts, top_k, norm, tmp_path_factory
):
    """Qwen2-MoE: Qwen2's attention (q/k/v biases) and a shared expert beside the routed
    ones, every token through it, its output scaled by a sigmoid gate."""

    from rl_jax.models.hf import load_hf

    d, hf_model = _hf_moe(tmp_path_factory, experts=experts, top_k=top_k, norm=norm, shared=40)
    want = _hf_logprobs(hf_model)
    ours = load_hf(d)
    spec = ours.spec
    assert (spec.architecture, spec.num_experts, spec.shared_expert_intermediate_size) == (
        "qwen2",
        experts,
        40,
    )
    assert spec.qkv_bias and not spec.o_bias and not spec.qk_norm
    _same_logprobs_and_round_trip(ours, want, "Qwen2MoeForCausalLM", tmp_path_factory)
    # The spec counts every parameter transformers has, the shared expert's among them.
    assert spec.num_params() == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parity
@pytest.mark.parametrize(
    "shared,more,dense",
    [
        (0, {"decoder_sparse_step": 2}, (0, 2)),  # every other layer sparse
        (40, {"mlp_only_layers": [0, 3]}, (0, 3)),  # Qwen2-MoE, dense first and last
    ],
)
def test_moe_with_dense_layers_loads_and_exports_with_transformers_logits(
    shared, more, dense, tmp_path_factory
):
    """A mixture of experts whose config makes some layers dense (Qwen3-MoE's and Qwen2-
    MoE's decoder_sparse_step, mlp_only_layers): each layer's MLP as transformers builds
    it, the same log-probs, an export transformers loads with them, every parameter
    counted."""
    from rl_jax.models.hf import load_hf

    d, hf_model = _hf_moe(
        tmp_path_factory, experts=4, top_k=2, norm=True, shared=shared, layers=4, **more
    )
    want = _hf_logprobs(hf_model)
    ours = load_hf(d)
    assert ours.spec.dense_layers == dense and ours.spec.mixed
    assert ours.spec.num_params() == sum(p.numel() for p in hf_model.parameters())
    cls = "Qwen2MoeForCausalLM" if shared else "Qwen3MoeForCausalLM"
    _same_logprobs_and_round_trip(ours, want, cls, tmp_path_factory)


def test_qwen3_moe_configs_name_their_dense_layers():
    from rl_jax.models.hf import CheckpointError, spec_fields_from_hf_config

    base = dict(
        model_type="qwen3_moe",
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    )
    fields = spec_fields_from_hf_config(base | {"norm_topk_prob": True})
    assert (fields["num_experts"], fields["norm_topk_prob"]) == (4, True)
    assert fields["dense_layers"] == ()
    # transformers 5's spelling of the expert count
    five = dict(base, num_local_experts=8)
    del five["num_experts"]
    assert spec_fields_from_hf_config(five)["num_experts"] == 8
    # Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not mlp-only.
    for more, dense in (
        ({"decoder_sparse_step": 2}, (0, 2)),
        ({"mlp_only_layers": [0]}, (0,)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, (0, 1, 2)),
    ):
        assert spec_fields_from_hf_config(base | more)["dense_layers"] == dense
    bad = (
        ({"decoder_sparse_step": 5}, "leave no sparse layer of 4"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be >= 1"),
        ({"mlp_only_layers": "0"}, "must be a list of layer indices"),
    )
    for more, message in bad:
        with pytest.raises(CheckpointError, match=message):
            spec_fields_from_hf_config(base | more)


MIXED = SPEC.replace(num_layers=3, dense_layers=(1,))


def test_dense_layers_are_counted_and_checked():
    """A mixed model's parameters and FLOPs are its layers' by kind; dense_layers that
    name no layer of a mixture of experts are refused."""
    sparse = SPEC.replace(num_layers=3)
    D, F, E, k, Fe = 64, SPEC.intermediate_size, SPEC.num_experts, 2, 48
    per_layer = 3 * D * F - (D * E + 3 * E * D * Fe)  # a dense MLP less a sparse one
    assert MIXED.num_params() - sparse.num_params() == per_layer
    assert MIXED.sparse_layers == (0, 2) and not sparse.mixed and MIXED.mixed
    active = 3 * D * F - (D * E + k * 3 * D * Fe)
    assert MIXED.flops_per_token(9) - sparse.flops_per_token(9) == 2 * active
    assert {n: i.shape[0] for n, i in _layout(MIXED).items() if n in ("gate", "router")} == {
        "gate": 1,
        "router": 2,
    }
    for bad in ((3,), (1, 0), (0, 1, 2), (True,)):
        with pytest.raises(ConfigError, match="dense_layers"):
            SPEC.replace(num_layers=3, dense_layers=bad)
    dense = SPEC.replace(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    with pytest.raises(ConfigError, match="of a mixture of experts"):
        dense.replace(dense_layers=(0,))


@pytest.mark.parametrize("scan", [True, False])
def test_a_mixed_model_decodes_records_and_replays_as_the_trainer(scan):
    """Dense layers among sparse ones, their layers rolled (each picks its kind by a
    conditional) or unrolled: the engine's decode step gives each sampled token the
    trainer's log-prob, records the sparse layers' experts (a dense layer's: zeros)
    as the trainer routes them, replaying them changes nothing, and the router's
    statistics are the sparse layers'."""
    spec = MIXED.replace(scan_layers=scan)
    params = _params(2, spec)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, length_bucket=8, max_prompt_len=16)
    engine = Engine(spec, cfg, slots=3, chunk=4, pad_id=0, record_routes=True)
    out, _ = engine.run(params, PROMPTS, n=2, seed=3)
    model = Transformer(spec, params)
    tokens, valid, positions = _sequences(out)
    logp = jax.jit(lambda *a: token_logprobs(model, a[0], a[2], kv_valid_bt=a[1])[0])(
        tokens, valid, positions
    )
    tp, m = out.prompt_tokens.shape[1], out.completion_mask
    np.testing.assert_allclose(out.logprobs[m], np.asarray(logp)[:, tp - 1 : -1][m], atol=1e-4)
    _, _, own = jax.jit(lambda *a: model(a[0], a[2], kv_valid_bs=a[1], record_routes=True))(
        tokens, valid, positions
    )
    fed = _fed(out)
    assert not out.routes[:, :, 1].any() and not np.asarray(own)[:, :, 1].any()
    got, want = np.sort(out.routes, axis=-1), np.sort(np.asarray(own), axis=-1)
    np.testing.assert_array_equal(got[fed], want[fed])
    assert got[fed][:, [0, 2]].all(axis=-1).any()  # experts > 0 chosen in sparse layers
    replayed = _replay_logprobs(spec, params, out, out.routes)
    np.testing.assert_allclose(replayed[m], _replay_logprobs(spec, params, out, None)[m], atol=1e-6)
    # Without the dense layer's MLP (its down projection zero): other tokens.
    cut = dict(params, down=params["down"] * 0)
    plain, _ = Engine(spec, cfg, slots=3, chunk=4, pad_id=0).run(cut, PROMPTS, n=2, seed=3)
    assert not np.array_equal(plain.completion_tokens, out.completion_tokens)
    pv, cv = jnp.ones((2, 4), bool), jnp.ones((4, 3), bool)
    stats = jax.jit(
        lambda p, c: model.shared_prefix(
            p,
            positions_from_valid(pv),
            pv,
            c,
            4 + jnp.zeros((4, 3), jnp.int32) + jnp.arange(3),
            cv,
            group_size=2,
            with_router=True,
        )[2]
    )(jnp.asarray(tokens[:2, :4]), jnp.asarray(tokens[:4, 4:7]))
    assert stats.load.shape == (2, spec.num_experts)
    np.testing.assert_array_equal(stats.tokens, [8 + 12] * 2)


def test_a_mixture_of_experts_on_a_family_without_one_does_not_export(tmp_path):
    from rl_jax.models import build_model
    from rl_jax.models.hf import CheckpointError, export_hf

    spec = resolve_spec(
        ModelConfig(
            preset="tiny",
            num_layers=1,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=8,
        )
    )
    with pytest.raises(CheckpointError, match="exports as Qwen3-MoE"):
        export_hf(build_model(spec), tmp_path / "out")


@pytest.mark.parity
@pytest.mark.devices(8)
def test_sharded_load_reads_each_experts_slice(tmp_path_factory):
    from rl_jax.config import MeshConfig
    from rl_jax.models import host_params
    from rl_jax.models.load import load_model
    from rl_jax.sharding import make_mesh

    d, _ = _hf_moe(tmp_path_factory, experts=4, top_k=2, norm=True)
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    sharded = load_model(d, mesh=mesh)
    plain = host_params(load_model(d))
    for name, arr in host_params(sharded).items():
        np.testing.assert_array_equal(arr, plain[name], err_msg=name)


# ---- training: `rl-jax train` on a tiny MoE, router losses and metrics ---------------------

MOE_RUN = [
    "model.preset=tiny-moe",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.moe_intermediate_size=64",
    "loss.router_aux_coef=0.01",
    "loss.router_z_coef=0.001",
    "mesh.num_devices=1",
    "train.steps=3",
    "eval.every=3",
    "eval.at_start=false",
]


def test_rl_jax_train_runs_a_tiny_moe_on_the_engine_with_router_terms(tmp_path, capsys):
    """`rl-jax train` on the CPU demo task's arithmetic prompts with a tiny MoE from a
    model directory, its middle layer dense (the trainer tests' verifier, so a random
    policy's groups disagree): three on-policy steps sampled on the engine, whose
    log-probs the trainer reproduces (ratios 1) while replaying the engine's routes
    (`model.routing_replay`), the router's loss terms in the loss, its metrics in every
    row."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "_workers"))
    import train_even_first

    from rl_jax.cli import main
    from rl_jax.data.tokenizer import CharTokenizer
    from rl_jax.models import build_model
    from rl_jax.models.native import save_model

    over = dict(hidden_size=64, moe_intermediate_size=64)  # MOE_RUN's, with 3 layers
    spec = resolve_spec(ModelConfig(preset="tiny-moe", num_layers=3, **over))
    model_dir = tmp_path / "model"
    save_model(build_model(spec.replace(dense_layers=(1,))), model_dir)
    CharTokenizer().save(model_dir)
    args = [*train_even_first.TINY_RUN, *MOE_RUN, f"out_dir={tmp_path}", "name=moe"]
    args = [a for a in args if not a.startswith("model.")] + [f"model.path={model_dir}"]
    args.append("model.routing_replay=true")
    assert main(["train", "scalerl", *args]) == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "moe" / "metrics.jsonl").read_text().splitlines()]
    # Each step trained, or was skipped (every group's rewards alike: nothing to learn).
    skipped = [r["step"] for r in rows if r.get("train/skipped_all_zero_variance")]
    rows = [r for r in rows if "train/loss" in r]  # the step rows (not the evaluation's)
    assert sorted([r["step"] for r in rows] + skipped) == [1, 2, 3] and len(rows) >= 2
    for r in rows:
        loads = [r[f"train/router_load/{j}"] for j in range(4)]
        assert sum(loads) == pytest.approx(1.0, abs=1e-5) and min(loads) > 0
        assert r["train/router_load_max"] == pytest.approx(4 * max(loads), rel=1e-5)
        assert 0 < r["train/router_entropy"] <= np.log(4) + 1e-6
        assert r["train/router_aux_loss"] >= 1.0 - 1e-5  # E sum f P >= 1 (Cauchy-Schwarz)
        # loss = policy loss + the router's terms at their coefficients
        terms = 0.01 * r["train/router_aux_loss"] + 0.001 * r["train/router_z_loss"]
        assert r["train/loss"] == pytest.approx(r["train/pg_loss"] + terms, abs=1e-5)
        # on-policy: the engine's decode and the trainer's forward route alike
        assert r["train/ratio_max"] - r["train/ratio_min"] < 1e-4
    curve = (tmp_path / "moe" / "curve.jsonl").read_text().splitlines()
    assert json.loads(curve[-1])["step"] == 3


@pytest.mark.parametrize("knob", ["loss.router_aux_coef=0.01", "model.routing_replay=true"])
def test_router_knobs_on_a_dense_model_are_refused_before_training(capsys, monkeypatch, knob):
    import rl_jax.train.loop as loop
    from rl_jax.cli import main

    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("reached the trainer"))
    rc = main(["train", "grpo", knob])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert knob.replace("true", "True") in err and "mixture-of-experts" in err


def test_load_balancing_loss_pulls_the_router_toward_balance():
    """The load-balancing term's gradient flows through the router's probabilities: a
    step against it makes routing more even (Switch Transformer's design)."""
    keys = jax.random.split(jax.random.key(0), 5)
    N, D, E, F = 64, 16, 4, 8
    h = jax.random.normal(keys[0], (N, D))
    router = jax.random.normal(keys[1], (D, E)).at[:, 0].add(1.0)  # expert 0 favoured
    shapes = [(E, D, F), (E, D, F), (E, F, D)]
    w = [jax.random.normal(kk, s) * 0.1 for kk, s in zip(keys[2:], shapes, strict=True)]

    def balance(r):
        _, stats, _ = moe_mlp(h, r, *w, top_k=1, norm_topk_prob=False)
        stats = jax.tree.map(lambda a: a[None], stats)  # one layer
        return aux_losses(stats, num_experts=E, top_k=1)["load_balance"]

    g = jax.grad(balance)(router)
    assert float(jnp.abs(g).max()) > 0
    before, after = balance(router), balance(router - 2.0 * g)
    assert float(after) < float(before)


def test_rl_jax_model_directory_round_trip(params, tmp_path):
    from rl_jax.models import host_params
    from rl_jax.models.load import load_model
    from rl_jax.models.native import save_model

    save_model(Transformer(SPEC, params), tmp_path / "m")
    back = load_model(str(tmp_path / "m"))
    assert back.spec.replace(scan_layers=SPEC.scan_layers) == SPEC
    for name, a in host_params(back).items():
        np.testing.assert_array_equal(a, np.asarray(params[name]), err_msg=name)


def test_lora_on_the_experts_is_refused_by_name(capsys, monkeypatch):
    import rl_jax.train.loop as loop
    from rl_jax.cli import main

    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("reached the trainer"))
    rc = main(["train", "scalerl", "model.preset=tiny-moe", "lora.enabled=true"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "lora.targets names 'gate'" in err and "mixture of experts" in err


@pytest.mark.devices(8)
@pytest.mark.parametrize("mixed", [False, True])
def test_sharded_forward_and_gradients_equal_one_devices(mixed):
    """On a data 2 x fsdp 2 x tensor 2 mesh each batch shard dispatches its own tokens and
    each tensor shard holds half of every expert's width: the log-probs, the router's
    statistics and the gradients are one device's. With a shared expert beside the
    routed ones, which XLA partitions as a dense MLP; `mixed`: and a dense layer between
    two sparse ones."""
    spec = (MIXED if mixed else SPEC).replace(shared_expert_intermediate_size=32)
    params = _params(1, spec)
    from rl_jax.config import MeshConfig
    from rl_jax.models import param_shardings
    from rl_jax.sharding import get_rules, make_mesh

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    rules = get_rules("fsdp_tp")
    P_, G, tp, tc = 4, 2, 6, 5
    rng = np.random.default_rng(1)
    args = (
        jnp.asarray(rng.integers(1, 64, (P_, tp))),
        jnp.broadcast_to(jnp.arange(tp), (P_, tp)),
        jnp.ones((P_, tp), bool),
        jnp.asarray(rng.integers(1, 64, (P_ * G, tc))),
        jnp.broadcast_to(tp + jnp.arange(tc), (P_ * G, tc)),
        jnp.ones((P_ * G, tc), bool).at[:, 4:].set(False),
    )

    # Replayed routes (routing replay): each token's k distinct experts, at random.
    L, E, k = spec.num_layers, spec.num_experts, spec.num_experts_per_tok
    pick = rng.random((P_ * tp + P_ * G * tc, L, E)).argsort(-1)[..., :k].astype(np.uint8)
    routes = (pick[: P_ * tp].reshape(P_, tp, L, k), pick[P_ * tp :].reshape(P_ * G, tc, L, k))

    def loss(p, mesh, routes):
        model = Transformer(spec.replace(scan_layers=True), p, mesh=mesh, rules=rules)
        _, xc, stats = model.shared_prefix(*args, group_size=G, with_router=True, routes=routes)
        lp = model.logits(xc).astype(jnp.float32)
        return jnp.mean(jax.nn.log_softmax(lp)[..., 0]) + 0.1 * stats.z.sum(), stats

    placed = jax.device_put(params, param_shardings(spec, mesh, rules))
    assert placed["expert_gate"].sharding.spec[1:4] == ("fsdp", None, "tensor")
    assert placed["shared_gate"].sharding.spec[1:3] == ("fsdp", "tensor")
    for given in (None, routes):
        grad = jax.value_and_grad(loss, has_aux=True)
        (l1, s1), g1 = jax.jit(lambda p, r: grad(p, None, r))(params, given)  # noqa: B023
        (l8, s8), g8 = jax.jit(lambda p, r: grad(p, mesh, r))(placed, given)  # noqa: B023
        np.testing.assert_allclose(l8, l1, rtol=1e-5)
        for a, b in zip(s8, s1, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5)
        for name in g1:
            np.testing.assert_allclose(g8[name], g1[name], atol=1e-5, rtol=1e-4, err_msg=name)
    # The replayed experts are the ones used: each sparse layer's load counts them (valid
    # tokens).
    for row, layer in enumerate(spec.sparse_layers):
        used = np.concatenate([routes[0][..., layer, :].ravel(), routes[1][:, :4, layer].ravel()])
        np.testing.assert_array_equal(s8.load[row], np.bincount(used, minlength=E))


def test_a_tpu_program_multiplies_each_token_through_its_experts_once(no_compilation_cache):
    """Compiled for 4 TPU chips (libtpu, from this host) with rows over data x fsdp, the
    forward's FLOPs per chip are a quarter of the model's: each chip dispatches its own
    rows. (Left to XLA's SPMD partitioner, a grouped matmul's ragged rows are not split:
    every chip multiplied all 4 shards' tokens through the experts, 2.9x the model's.)"""
    from rl_jax.config import MeshConfig
    from rl_jax.models import param_shardings
    from rl_jax.sharding import get_rules, make_mesh

    devices = _v5e_devices()
    spec = SPEC.replace(num_layers=1, scan_layers=True)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=1), devices)
    rules = get_rules("fsdp_tp")
    B, T = 8, 64
    p_sh = param_shardings(spec, mesh, rules)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp")))

    def forward(p, tokens):
        model = Transformer(spec, p, mesh=mesh, rules=rules)
        return model.logits(model(tokens)[0])

    params = {n: jax.ShapeDtypeStruct(i.shape, jnp.float32) for n, i in _layout(spec).items()}
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    compiled = jax.jit(forward, in_shardings=(p_sh, rows)).lower(params, tokens).compile()
    cost = compiled.cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    model_flops = spec.sequence_flops(T) * B / 4  # causal attention included
    assert 0.9 < flops / model_flops < 1.3, flops / model_flops
    # The experts' matmuls are megablox's Mosaic kernels (attention at 64 keys is dense).
    assert "tpu_custom_call" in compiled.as_text()


def test_a_tpu_route_replays_experts_for_no_more_bytes_than_its_top_k(no_compilation_cache):
    """Compiled for a TPU chip (libtpu, from this host), the router's forward and backward
    with replayed experts moves no more bytes than with its own top k. (Taken with a
    gather, the replayed experts' weights counted 91x the top k's bytes: its backward
    is a scatter; on the 30B-A3B plan, +19% of the train step's.)"""
    devices = _v5e_devices()
    one = jax.sharding.SingleDeviceSharding(devices[0])
    N, D, E, k = 4096, 128, 8, 2

    def weights(x, r, *given):
        _, _, w = route(x, r, top_k=k, norm_topk_prob=True, experts=given[0] if given else None)
        return jnp.sum(w * jnp.arange(k))

    def bytes_moved(*shapes):
        args = [jax.ShapeDtypeStruct(s, d, sharding=one) for s, d in shapes]
        cost = jax.jit(jax.grad(weights, argnums=1)).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]

    own = bytes_moved(((N, D), jnp.float32), ((D, E), jnp.float32))
    replayed = bytes_moved(((N, D), jnp.float32), ((D, E), jnp.float32), ((N, k), jnp.uint8))
    assert replayed <= own, (replayed, own)


def _v5e_devices() -> list:
    """A v5e:2x2 topology's devices to compile for (libtpu, from this host), else skip."""
    try:
        from rl_jax.plan import topology_devices

        return topology_devices("v5e:2x2")
    except ConfigError as e:
        pytest.skip(f"libtpu cannot describe a TPU topology here: {e}")


def _layout(spec):
    from rl_jax.models.transformer import param_layout

    return param_layout(spec)


def test_plan_estimate_counts_the_experts_a_token_goes_through():
    """`rl-jax plan`'s memory estimate: a token's MLP activations are its k experts'
    (k x moe_intermediate_size), whatever the family's dense width says."""
    from rl_jax.config import load_recipe
    from rl_jax.plan import CHIPS
    from rl_jax.plan._estimate import estimate

    cfg = load_recipe("scalerl", ["model.preset=tiny-moe"])
    mesh = {"data": 1, "fsdp": 2, "tensor": 2}
    moe = resolve_spec(cfg.model)

    def activations(spec):
        return estimate(spec, cfg, mesh, CHIPS["v5e"])["parts"]["activations"]

    acts = activations(moe)
    assert activations(moe.replace(intermediate_size=8)) == acts
    assert activations(moe.replace(num_experts_per_tok=3)) > acts
    # The decode step's weights: the experts over fsdp x tensor (they stay in place),
    # the rest over tensor; colocated, and split mode's sampler (no fsdp) holds them all.
    L, E, D, Fe = moe.num_layers, moe.num_experts, moe.hidden_size, moe.moe_intermediate_size
    experts, rest = L * E * 3 * D * Fe, moe.num_params() - L * E * 3 * D * Fe
    parts = estimate(moe, cfg, mesh, CHIPS["v5e"])["parts"]
    assert parts["sampler_weights"] == pytest.approx(4 * (rest / 2 + experts / 4))
    split = estimate(moe, cfg, mesh, CHIPS["v5e"], sampler=2)["parts"]
    assert split["sampler_weights"] == pytest.approx(4 * (rest + experts) / 2)


def test_convert_writes_over_its_own_previous_moe_export(params, tmp_path):
    """`rl-jax convert` replaces a previous HF export of its own (a Qwen3-MoE one too)
    without --force."""
    from rl_jax.cli.convert import check_output_dir
    from rl_jax.models.hf import export_hf

    out = export_hf(Transformer(SPEC, params), tmp_path / "out")
    check_output_dir(out, "hf", force=False)  # no ConfigError


@pytest.mark.parametrize("M,G,short", [(13, 3, 0), (100, 8, 2), (7, 16, 1)])
def test_grouped_matmul_gradients_equal_ragged_dots(M, G, short):
    """`kernels.grouped_matmul`'s own backward (blocked weight gradient) against JAX's
    autodiff of ragged_dot, groups of random sizes, some empty, rows past the groups."""
    from rl_jax.kernels.xla import grouped_matmul

    rng = np.random.default_rng(M)
    D, N = 5, 4
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(G, D, N)), jnp.float32)
    sizes = rng.multinomial(M, np.ones(G) / G)
    sizes[-1] = max(sizes[-1] - short, 0)
    gs = jnp.asarray(sizes, jnp.int32)

    def grads(f):
        return jax.grad(lambda x, w: jnp.sum(f(x, w, gs) * dy), argnums=(0, 1))(x, w)

    for got, want in zip(grads(grouped_matmul), grads(jax.lax.ragged_dot), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_tpu_backward_counts_each_rows_weight_gradient_once(no_compilation_cache):
    """libtpu counts (and XLA:CPU computes) ragged_dot's own weight gradient over every
    group: 64x the backward's FLOPs at 128 experts. grouped_matmul's is its rows'."""
    from rl_jax.kernels.xla import grouped_matmul

    devices = _v5e_devices()
    one = jax.sharding.SingleDeviceSharding(devices[0])
    M, D, N, G = 4096, 256, 128, 128
    f = jax.jit(
        jax.grad(lambda x, w, g: grouped_matmul(x, w, g).astype(jnp.float32).sum(), (0, 1)),
        in_shardings=(one, one, one),
    )
    shapes = [(M, D), (G, D, N), (G,)]
    dtypes = [jnp.bfloat16, jnp.bfloat16, jnp.int32]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    cost = f.lower(*args).compile().cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    # dx and dw, 2 M D N each (the weight gradient's loop body counts once here)
    assert flops < 1.3 * 4 * M * D * N, flops / (4 * M * D * N)


@pytest.mark.devices(8)
@pytest.mark.parametrize(
    "axes,mixed",
    [((8, 1, 1), False), ((4, 1, 2), False), ((2, 2, 2), False), ((2, 2, 2), True)],
    ids=["data8", "data4_tensor2", "fsdp2_tensor2", "mixed_fsdp2_tensor2"],
)
def test_engine_on_a_mesh_samples_one_devices_rollouts(params, axes, mixed):
    """The engine's prefill (the model's forward, its sparse MLP per batch shard) and
    decode on a mesh (one device's rows per device, or, with fsdp, its experts staying
    over fsdp as the tokens come to them): one device's rollouts, and the routes it
    records; `mixed`: with a dense layer between two sparse ones."""
    from rl_jax.config import MeshConfig
    from rl_jax.sharding import make_mesh

    spec, params = (MIXED, _params(2, MIXED)) if mixed else (SPEC, params)
    data, fsdp, tensor = axes
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8, length_bucket=8, max_prompt_len=16)
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor, rules="fsdp_tp"))
    kw = dict(slots=8, chunk=3, pad_id=0, record_routes=True)
    one, _ = Engine(spec, cfg, **kw).run(params, PROMPTS, n=3, seed=9)
    many = Engine(spec, cfg, **kw, mesh=mesh)
    got, _ = many.run(many.reshard(params), PROMPTS, n=3, seed=9)
    np.testing.assert_array_equal(got.completion_tokens, one.completion_tokens)
    np.testing.assert_allclose(got.logprobs, one.logprobs, atol=1e-5)
    np.testing.assert_array_equal(np.sort(got.routes, -1), np.sort(one.routes, -1))


@pytest.mark.parametrize("dense", [(0, 2), (1, 4, 5), (0,), (5,)])
def test_a_plan_counts_each_layers_kind(monkeypatch, dense):
    """`_layer_costs` of a mixed model from its 1- and 2-layer counting programs: exact
    for costs that add up by layer, where a prefill's last layer computes its keys and
    values only (its MLP, dense or sparse, is dead code). The programs' counts stand in
    for their compiles (benchmarks/mixed_layer_costs.py sets the count against compiled
    whole programs)."""
    from rl_jax.plan import _programs as pp

    mlp = {True: np.array([7.0, 70.0]), False: np.array([3.0, 40.0])}  # sparse, dense
    attn, kv, base = np.array([2.0, 10.0]), np.array([1.0, 5.0]), np.array([100.0, 900.0])

    def cost(spec, name):  # what a program of `spec` would count
        layers = [attn + kv + mlp[i in spec.sparse_layers] for i in range(spec.num_layers)]
        if name == "prefill_insert":  # the last layer's keys and values only
            layers[-1] = kv
        return base + sum(layers)

    class Counted:  # `Target.programs`' result for a counting program's spec
        def __init__(self, spec):
            assert not spec.scan_layers  # each layer's kind known while tracing
            self.spec = spec

        def step_programs(self, tp, tg, minibatches):
            return {n: (n, (self.spec,), {}) for n in ("train_step", "prefill_insert")}

    def submit(name, spec, **kw):
        return types.SimpleNamespace(result=lambda: cost(spec, name))

    monkeypatch.setattr(pp, "_submit", submit)
    spec = SPEC.replace(num_layers=6, dense_layers=dense, scan_layers=True)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(updates_per_batch=1))
    t = types.SimpleNamespace(cfg=cfg, spec=spec, mesh=None, tp=8, tg=8, programs=Counted)
    got = pp._layer_costs(t)
    for name in ("train_step", "prefill_insert"):
        np.testing.assert_allclose(got[name], cost(spec, name))
