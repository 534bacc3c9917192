"""The continuous-batching engine on the small random model of test_sampler: the
rollouts of one batch decoded in step (a slot for every row: `test_sampler.sample`,
itself checked against the model) whatever the slot count and refill order, stops,
forced interruption, per-row limits, in-flight weight swaps, bounded compiles."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampler import PROMPTS, SPEC, _params, _sequences, _swapped_logits, sample

from rl_jax.config import MeshConfig, SamplingConfig
from rl_jax.sampling import DecodeWeights, Engine, FinishReason
from rl_jax.sharding import make_mesh

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12, length_bucket=8, max_prompt_len=16)
SAMPLED = SamplingConfig(
    temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, length_bucket=8, max_prompt_len=16
)


@pytest.fixture(scope="module")
def params_a():
    return _params(0)


@pytest.fixture(scope="module")
def params_b():
    return _params(1)


def _assert_same(a, b, *, exact):
    """Two sets of rollouts equal: tokens, masks, lengths and flags exactly; log-probs
    bit for bit (`exact`) or to the whole-model float32 tolerance."""
    for f in ("completion_tokens", "completion_mask", "injected_mask", "versions", "lengths"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    for f in ("finish_reason", "truncated", "group_ids", "row_ids"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    if exact:
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    else:
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _stop_token(params):
    """A token the greedy model emits early in some rows but not all (a real stop)."""
    free = sample(params, PROMPTS, GREEDY)
    return int(free.completion_tokens[0, 2])


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_refilled_slots_equal_one_batch_with_stop_tokens(params_a, cfg):
    """Three slots for six rows: rows wait, enter freed slots, end at a stop token: the
    rollouts of a slot for every row (the same tokens; log-probs to float32 rounding,
    as that engine prefills every prompt at once, at its longest length: XLA:CPU's
    prefill matmuls round differently for other shapes)."""
    stop = _stop_token(params_a)
    ref = sample(params_a, PROMPTS, cfg, n=2, seed=5, version=3, engine={"eos_id": stop})
    engine = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0, eos_id=stop)
    out, stats = engine.run(params_a, PROMPTS, n=2, seed=5, version=3)
    _assert_same(out, ref, exact=False)
    assert (out.finish_reason == FinishReason.STOP).any()
    assert (out.versions[out.completion_mask] == 3).all()
    assert stats.prompts_prefilled == len(PROMPTS)  # each prompt prefilled once
    assert stats.kept_tokens == out.completion_mask.sum() <= stats.slot_steps
    if cfg.temperature > 0:
        assert len({tuple(r) for r in out.completion_tokens[:2]}) == 2  # samples differ


@pytest.mark.parametrize("reads", ["one_pass", "blocked"])
def test_paged_reference_equals_the_kernels(monkeypatch, reads):
    """The engine's paged cache read by XLA's reference (no CPU kernels): every page of
    a row's table at once, or in blocks of pages up to the furthest row's (an online
    softmax, as long caches on CPU are read), with pages of 8 positions so that rows
    span several, slots refilled as rows end at their own limits; both equal one batch
    on the platform's decode step (the CPU kernels here). Their softmaxes run over other
    spans, so weights scaled by 3, as test_sampler's `mild_params` for the same reason
    (by 10, one log-prob of 240 was 1.05e-5 off)."""
    from rl_jax.kernels import xla

    params = _params(0, 3.0)
    cfg = dataclasses.replace(SAMPLED, max_new_tokens=40)
    limits = [40, 7, 21, 33, 2, 16]  # rows at different steps share every chunk
    ref = sample(params, PROMPTS, cfg, n=2, seed=2, max_new_tokens=limits)
    monkeypatch.setattr(Engine, "platform_attention", False)
    monkeypatch.setattr(Engine, "platform_matmul", False)
    if reads == "blocked":
        monkeypatch.setattr(xla, "DECODE_BLOCK_MIN_SLOTS", 8)
        monkeypatch.setattr(xla, "DECODE_BLOCKS", 4)
        monkeypatch.setattr(xla, "DECODE_BLOCK_PLATFORMS", (jax.devices()[0].platform,))
    engine = Engine(SPEC, cfg, slots=3, chunk=8, pad_id=0, page_size=8)
    assert not engine.decode_ops.platform_ops
    cache = engine.init().slots.cache  # [K, L, N, P, hd]: 7 pages per row (16 + 40 - 1)
    assert engine.row_pages == 7 and cache.keys.shape == (2, 2, 3 * 7, 8, 16)
    out, stats = engine.run(params, PROMPTS, n=2, seed=2, max_new_tokens=limits)
    _assert_same(out, ref, exact=False)
    assert stats.pages_held == 0 and stats.pages == 21


def test_same_rollouts_whatever_the_slot_count_and_refill_order(params_a):
    """Bit for bit: a row's numbers depend on its key, prompt and weights only, not on
    the slot count, the refill order or the rows a call inserts. (With
    the prompts prefilled at a varying prompt count they did not: XLA:CPU's prefill
    matmuls round differently for 1 and 4 prompts, ~1e-6 in the log-probs; so
    the prefill always takes whole blocks of `prefill_block` prompts.)"""
    rng = np.random.default_rng(0)
    order = rng.permutation(len(PROMPTS) * 3)
    runs = {
        (slots, shuffled): Engine(SPEC, SAMPLED, slots=slots, chunk=3, pad_id=0).run(
            params_a, PROMPTS, n=3, seed=9, order=order if shuffled else None
        )[0]
        for slots, shuffled in ((2, False), (3, True), (8, True))
    }
    # Rows inserted one a call (the default for 8 slots) or all 8 in one.
    whole = Engine(SPEC, SAMPLED, slots=8, chunk=3, pad_id=0, insert_rows=8)
    runs["whole"] = whole.run(params_a, PROMPTS, n=3, seed=9, order=order)[0]
    first = runs[(2, False)]
    for out in runs.values():
        _assert_same(out, first, exact=True)


@pytest.mark.devices(8)
def test_same_rollouts_on_eight_devices(params_a):
    """Slots split over 8 devices (each decoding its own rows in its own loop) give
    one device's rollouts."""
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    eight = Engine(SPEC, SAMPLED, slots=8, chunk=3, pad_id=0, mesh=mesh)
    resharded = eight.reshard(params_a)
    got, _ = eight.run(resharded, PROMPTS, n=3, seed=9)
    eight.run(resharded, PROMPTS, n=3, seed=1)
    # Each call takes the state in the layout the last one left it in: one program each.
    assert eight.compile_counts() == {"prefill_insert": 1, "generate": 1, "prepare": 1}
    one, _ = Engine(SPEC, SAMPLED, slots=8, chunk=3, pad_id=0).run(params_a, PROMPTS, n=3, seed=9)
    _assert_same(got, one, exact=False)


@pytest.mark.devices(8)
def test_paged_cache_on_a_mesh_with_a_tensor_axis(params_a):
    """Rows and their pages over 4 devices, kv heads over 2 (the paged attention per
    device under shard_map, page ids each device's own): one device's rollouts."""
    mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2, rules="fsdp_tp"))
    one, _ = Engine(SPEC, SAMPLED, slots=8, chunk=3, pad_id=0).run(params_a, PROMPTS, n=3, seed=9)
    eight = Engine(SPEC, SAMPLED, slots=8, chunk=3, pad_id=0, mesh=mesh)
    keys = eight.init().slots.cache.keys  # [K, L, N, P, hd]
    assert keys.sharding.shard_shape(keys.shape)[:3] == (1, 2, eight.kv_pages // 4)
    got, stats = eight.run(eight.reshard(params_a), PROMPTS, n=3, seed=9)
    _assert_same(got, one, exact=False)
    assert stats.pages_held == 0


@pytest.mark.devices(8)
def test_prefill_blocks_on_eight_devices(params_a):
    """Prefill blocks of 8 prompts, one per device, on a mesh: 10 new prompts fill two
    blocks (the second padded), and the rows are one device's."""
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    prompts = [*PROMPTS, *PROMPTS, *PROMPTS, [5, 6]]
    kw = dict(slots=16, chunk=3, pad_id=0, prefill_prompts=16, prefill_block=8)
    eight = Engine(SPEC, SAMPLED, mesh=mesh, **kw)
    got, stats = eight.run(eight.reshard(params_a), prompts, n=1, seed=9)
    assert stats.prompts_prefilled == 10 and eight.prefill_block == 8
    one, _ = Engine(SPEC, SAMPLED, **kw).run(params_a, prompts, n=1, seed=9)
    _assert_same(got, one, exact=False)


def test_forced_interruption_and_per_row_limits(params_a):
    inject = [5, 6, 7]
    cfg = SamplingConfig(
        temperature=1.0,
        max_new_tokens=14,
        length_bucket=8,
        max_prompt_len=16,
        length_control="interrupt",
        interrupt_lo=2,
        interrupt_hi=5,
        answer_budget=3,
    )
    ref = sample(params_a, PROMPTS, cfg, n=2, engine={"interrupt_ids": inject})
    engine = Engine(SPEC, cfg, slots=4, chunk=5, pad_id=0, interrupt_ids=inject)
    out, _ = engine.run(params_a, PROMPTS, n=2)
    _assert_same(out, ref, exact=False)
    assert out.injected_mask.any(axis=1).all()

    # A row ends at its own limit (the long-tail benchmark's forced lengths).
    limits = [3, 14, 7, 1, 9, 5]
    free = dataclasses.replace(cfg, length_control="truncate", interrupt_lo=0, interrupt_hi=0)
    ref = sample(params_a, PROMPTS, free, n=2, max_new_tokens=limits)
    out, stats = Engine(SPEC, free, slots=2, chunk=4, pad_id=0).run(
        params_a, PROMPTS, n=2, max_new_tokens=limits
    )
    _assert_same(out, ref, exact=False)
    np.testing.assert_array_equal(out.lengths, limits)
    assert (out.finish_reason == FinishReason.LENGTH).all() and out.truncated.all()
    assert stats.kept_tokens == sum(limits)


def test_weight_swap_between_chunks(params_a, params_b):
    """Chunk 0 under A (version 1), the rest under B (version 2). Rows in slots at
    the swap keep the cache A wrote and continue under B, as one batch's rows do;
    rows entering later are B's alone."""
    k = 4
    engine = Engine(SPEC, GREEDY, slots=3, chunk=k, pad_id=0)

    def weights(chunk):
        return (params_a, 1) if chunk == 0 else (params_b, 2)

    out, _ = engine.run(params_a, PROMPTS, n=1, weights=weights)
    m = out.completion_mask
    assert (out.versions[:, :k] == 1).all() and (out.versions[:, k:][m[:, k:]] == 2).all()
    # One batch's swap: k tokens from A, the rest from B on A's cache.
    chunked = dataclasses.replace(GREEDY, decode_chunk=k)
    ref = sample(params_a, PROMPTS, chunked, weights=weights)
    _assert_same(out, ref, exact=False)
    # ... which is the model's own cached forward, A then B (test_sampler's reference).
    tp = ref.prompt_tokens.shape[1]
    logits = np.asarray(_swapped_logits(params_a, params_b, *_sequences(ref), tp + k - 1))
    np.testing.assert_array_equal(logits[:, : 12 - k].argmax(-1), out.completion_tokens[:, k:12])

    # Four slots, eight rows: the second four enter after the swap and see B only.
    engine = Engine(SPEC, GREEDY, slots=4, chunk=12, pad_id=0)
    out, _ = engine.run(params_a, PROMPTS[:2] * 2, n=2, weights=weights)
    assert (out.versions[:4, :12] == 1).all() and (out.versions[4:, :12] == 2).all()
    only_b = sample(params_b, PROMPTS[:2], GREEDY, n=2)
    np.testing.assert_array_equal(out.completion_tokens[4:], only_b.completion_tokens)
    np.testing.assert_allclose(out.logprobs[4:], only_b.logprobs, atol=1e-5)


def test_compiles_stay_bounded(params_a, params_b):
    """Two programs: prompts of several lengths in one bucket, new
    weights, other seeds, refills with and without new prompts: one generate, one
    prefill_insert; a second prompt bucket, one more prefill_insert. With
    fixed_shapes, one prefill_insert whatever the buckets."""
    engine = Engine(SPEC, GREEDY, slots=4, chunk=4, pad_id=0)
    prompts = [[3, 9, 4], [7, 1, 8, 2, 6, 5, 11], [12, 13], [2, 3, 4, 5, 6]]  # bucket 8
    engine.run(params_a, prompts, n=2)
    assert engine.compile_counts() == {"prefill_insert": 1, "generate": 1, "prepare": 1}
    engine.run(params_b, [p[:-1] + [1] for p in prompts], n=2, seed=4)
    engine.run(params_a, prompts[:3], n=3, seed=1, weights=lambda c: (params_b, c))
    assert engine.compile_counts() == {"prefill_insert": 1, "generate": 1, "prepare": 1}
    engine.run(params_a, [list(range(1, 12))], n=1)  # a second bucket (16)
    assert engine.compile_counts() == {"prefill_insert": 2, "generate": 1, "prepare": 1}
    fixed = Engine(SPEC, GREEDY, slots=4, chunk=4, pad_id=0, fixed_shapes=True)
    fixed.run(params_a, [*prompts, list(range(1, 12))], n=2)
    assert fixed.compile_counts() == {"prefill_insert": 1, "generate": 1, "prepare": 1}


def test_prefill_blocks_compute_the_rows_of_a_whole_prefill(params_a, params_b):
    """A prefill in blocks of 2 prompts (blocks without a new prompt skipped, the last
    one padded) gives the rows of prefills of 2 prompts at a time, bit for bit, with 4
    or 5 prompts a prefill; one prefill_insert and one generate program whatever the
    refills."""
    prompts = [*PROMPTS, [5, 6], [9, 10, 11, 12]]  # one bucket of 8
    runs = {}
    for prompts_per_prefill, block in ((2, None), (4, 2), (5, 2)):
        engine = Engine(
            SPEC,
            SAMPLED,
            slots=5,
            chunk=3,
            pad_id=0,
            prefill_prompts=prompts_per_prefill,
            prefill_block=block,
        )
        assert engine.prefill_block == 2
        runs[prompts_per_prefill] = engine.run(params_a, prompts, n=1, seed=4)[0]
        engine.run(params_b, prompts[:2], n=3, seed=1)  # refills of fewer prompts
        assert engine.compile_counts() == {"prefill_insert": 1, "generate": 1, "prepare": 1}
    for out in runs.values():
        _assert_same(out, runs[2], exact=True)


def test_fixed_shapes_same_rollouts(params_a):
    """Every prompt prefilled at prompt_len (the trainer's engines) gives the rollouts
    of each prompt prefilled in its own bucket; only the prefill's padding differs
    (float32 rounding of other matmul shapes, so log-probs to the model tolerance)."""
    prompts = [*PROMPTS, list(range(1, 12))]  # buckets 8 and 16
    out = {
        fixed: Engine(SPEC, SAMPLED, slots=3, chunk=4, pad_id=0, fixed_shapes=fixed).run(
            params_a, prompts, n=2, seed=3
        )[0]
        for fixed in (False, True)
    }
    _assert_same(out[True], out[False], exact=False)
    assert out[True].lengths.min() > 0


def test_evaluation_slots_bound_its_cache():
    """Evaluation (on the engine by default) holds a slot per row, or
    sampling.engine_slots: its KV cache is that many rows, however many it samples."""
    from rl_jax.config import apply_overrides, load_recipe
    from rl_jax.train.evaluation import make_eval_sampler

    class Tok:
        eos_id, pad_id = 1, 0

        def encode(self, text):
            return [2, 3]

    small = ["sampling.max_new_tokens=8", "sampling.length_control=truncate"]
    cfg = load_recipe("scalerl", [*small, "eval.num_prompts=8", "eval.k=2"])
    full = make_eval_sampler(SPEC, cfg, Tok(), mesh=None, prompt_len=16)
    capped = make_eval_sampler(
        SPEC, apply_overrides(cfg, ["sampling.engine_slots=4"]), Tok(), mesh=None, prompt_len=16
    )
    assert isinstance(full, Engine) and (full.slots, capped.slots) == (16, 4)
    for engine in (full, capped):
        pages = jax.eval_shape(engine._init_impl).slots.cache.values.shape[2]
        assert pages == engine.slots * engine.row_pages


def test_overlapped_host_loop_gives_the_same_rollouts(params_a):
    """`run` dispatches chunk k + 1 before it reads chunk k (the default): slots refill a
    chunk later, and a chunk's columns go to the rows that were in its slots when it
    was dispatched, not to rows a refill put there since. Bit for bit the rollouts of
    the loop that reads each chunk before the next, with stop tokens, per-row limits,
    rows waiting for slots and the timeline's thread watching the chunks."""
    stop = _stop_token(params_a)
    engine = Engine(SPEC, SAMPLED, slots=3, chunk=2, pad_id=0, eos_id=stop)
    limits = [3, 10, 7, 1, 9, 5]
    a, sa = engine.run(params_a, PROMPTS, n=2, seed=4, max_new_tokens=limits, overlap=False)
    b, sb = engine.run(params_a, PROMPTS, n=2, seed=4, max_new_tokens=limits, timeline=True)
    _assert_same(b, a, exact=True)
    assert (a.finish_reason == FinishReason.STOP).any()
    assert sa.device_idle is None and 0 <= sb.device_idle < 1
    assert sb.slot_steps > sa.slot_steps and sb.kept_tokens == sa.kept_tokens
    assert sa.pages_held == sb.pages_held == 0


def test_decode_weights_are_made_once_per_version(params_a, params_b):
    """`generate` on a version's `DecodeWeights` (`prepare`) gives what it gives on the
    params, bit for bit; `prepared` makes them once per (params, version) and drops the
    old layout for a new one; `run` prepares each chunk's weights once and keeps nothing
    after it."""
    engine = Engine(SPEC, SAMPLED, slots=3, chunk=4, pad_id=0, insert_rows=3)
    key = jax.random.key(2)
    pages = [list(range(i * engine.row_pages, (i + 1) * engine.row_pages)) for i in range(3)]

    def chunk(weights):
        state = engine.init()
        state = engine.prefill_insert(
            params_a,
            state,
            PROMPTS[:1],
            [0],
            [0, 1, 2],
            [0] * 3,
            [0, 1, 2],
            [0] * 3,
            key=key,
            pages=pages,
        )
        state, out = engine.generate(weights, state, version=1)
        return jax.device_get(state.slots.cache), out

    (cache_p, out_p), (cache_w, out_w) = chunk(params_a), chunk(engine.prepare(params_a))
    for a, b in zip(
        jax.tree.leaves((cache_p, out_p.tokens, out_p.logprobs)),
        jax.tree.leaves((cache_w, out_w.tokens, out_w.logprobs)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    w = engine.prepared(params_a, 1)
    assert engine.prepared(params_a, 1) is w and engine.prepare(w) is w
    assert engine.prepared(params_a, 2) is not w and engine.prepared(params_b, 2) is not w
    engine.drop_prepared()
    assert engine._prepared is None
    made = []
    real = engine.prepare
    engine.prepare = lambda p: (
        real(p) if isinstance(p, DecodeWeights) else made.append(p) or real(p)
    )
    # Chunk 0 under A (version 1), the rest under B (version 2): two layouts made.
    weights = lambda c: (params_a, 1) if c == 0 else (params_b, 2)  # noqa: E731
    engine.run(params_a, PROMPTS, n=2, weights=weights)
    assert [p is params_a for p in made] == [True, False] and engine._prepared is None


def test_int8_kv_cache_stays_near_the_float_cache():
    """kv_quant="int8": keys and values int8 with a float32 scale per position and kv
    head. Each vector comes back within half a step of its scale (max |x| / 127); the
    engine's rows follow the float32 cache's (the same first tokens, log-probs on the
    tokens both drew within 0.05: benchmarks/kv_drift.py measures real models)."""
    from rl_jax.kernels.xla import dequantize_int8, quantize_int8

    x = jax.random.normal(jax.random.key(0), (5, 3, 16)) * jnp.arange(1, 4)[None, :, None]
    q, scale = quantize_int8(x)
    assert q.dtype == jnp.int8 and scale.shape == (5, 3)
    err = jnp.abs(dequantize_int8(q, scale) - x)
    assert bool((err <= scale[..., None] / 2 + 1e-6).all())
    assert bool((quantize_int8(jnp.zeros((2, 16)))[0] == 0).all())

    params = _params(0, 3.0)
    cfg = dataclasses.replace(GREEDY, max_new_tokens=16)
    ref, _ = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0).run(params, PROMPTS, n=2)
    int8 = Engine(SPEC, cfg, slots=3, chunk=4, pad_id=0, kv_quant="int8")
    cache = int8.init().slots.cache
    assert cache.keys.dtype == cache.values.dtype == jnp.int8
    assert cache.scales.shape == (*cache.values.shape[:4], 2)
    out, stats = int8.run(params, PROMPTS, n=2)
    same = out.completion_tokens == ref.completion_tokens
    first = np.where((~same).any(axis=1), (~same).argmax(axis=1), same.shape[1])
    assert (first >= 1).all() and stats.pages_held == 0
    prefix = np.arange(same.shape[1])[None, :] < first[:, None]
    np.testing.assert_allclose(out.logprobs[prefix], ref.logprobs[prefix], atol=0.05)


def test_page_book_hands_each_page_to_one_slot_at_a_time():
    """Pages per batch shard: a slot takes pages of its own shard, never a held one,
    and gives them back; the book knows what is free."""
    from rl_jax.sampling._slots import PageBook

    book = PageBook(shards=2, slots_per_shard=2, pages_per_shard=5)
    a, b = book.take(0, 3), book.take(1, 2)
    assert set(a).isdisjoint(b) and book.free(0) == 0 and book.free(2) == 5
    c = book.take(2, 4)  # shard 1: its own page numbers
    assert book.in_use() == 9 and book.peak == 9 and sorted(c) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="needs 2 pages; shard 1 has 1"):
        book.take(3, 2)
    with pytest.raises(RuntimeError, match="holding"):
        book.take(0, 1)
    book.give_back(0)
    d = book.take(0, 3)
    assert sorted(d) == sorted(a)
    for slot in (0, 1, 2):
        book.give_back(slot)
    assert book.in_use() == 0 and book.free(0) == 5 and book.free(3) == 5


def test_rows_of_random_lengths_share_a_small_page_pool(params_a):
    """40 rows of random limits (1 to 24 tokens, prompts of 2 to 16) and a stop token
    through 4 slots and 6 pages of 8 positions, where a longest row needs 5: rows wait
    for pages as well as slots. The rollouts are those of a pool with a page table for
    every slot (bit for bit: had a page gone to two live rows, one's keys would be the
    other's), and every page is free at the end."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 60, size=rng.integers(2, 17)).tolist() for _ in range(10)]
    limits = rng.integers(1, 25, size=40)
    cfg = dataclasses.replace(SAMPLED, max_new_tokens=24)
    stop = _stop_token(params_a)
    kw = dict(slots=4, chunk=3, pad_id=0, eos_id=stop, page_size=8 if not _kernels() else 16)
    small = Engine(SPEC, cfg, kv_pages=4 if _kernels() else 6, **kw)
    assert small.row_pages * 4 > small.kv_pages >= small.row_pages
    out, stats = small.run(params_a, prompts, n=4, seed=7, max_new_tokens=limits)
    ref, full = Engine(SPEC, cfg, **kw).run(params_a, prompts, n=4, seed=7, max_new_tokens=limits)
    _assert_same(out, ref, exact=True)
    assert stats.pages_held == 0 and stats.pages_peak <= small.kv_pages
    assert stats.chunks > full.chunks  # rows waited for pages
    assert (out.finish_reason == FinishReason.STOP).any() and (out.lengths == limits).any()


def _kernels() -> bool:
    """Whether the engine decodes with the CPU attention kernel (pages of 16)."""
    return "attention" in Engine(SPEC, GREEDY, slots=1).decode_ops.platform_ops


def _mesh(data):
    return make_mesh(MeshConfig(data=data, fsdp=1, tensor=1), devices=jax.devices()[:data])


def test_engine_errors():
    with pytest.raises(ValueError, match="max_prompt_len"):
        Engine(SPEC, SamplingConfig(), slots=2)
    with pytest.raises(ValueError, match="slots=0"):
        Engine(SPEC, GREEDY, slots=0)
    engine = Engine(SPEC, GREEDY, slots=2)
    with pytest.raises(ValueError, match="prompt_len=16"):
        engine.run({}, [list(range(1, 20))], n=1)
    with pytest.raises(ValueError, match="permutation"):
        engine.run({}, PROMPTS, n=1, order=[0, 0, 1])
    with pytest.raises(ValueError, match="kv_quant='fp4': one of None, int8"):
        Engine(SPEC, GREEDY, slots=2, kv_quant="fp4")
    with pytest.raises(ValueError, match="kv_pages=1: .* at least a longest row's 2 pages"):
        Engine(SPEC, GREEDY, slots=2, page_size=16, kv_pages=1)
    with pytest.raises(ValueError, match="kv_pages=5: need a multiple of the 2 batch shards"):
        Engine(SPEC, GREEDY, slots=2, page_size=16, kv_pages=5, mesh=_mesh(2))
    if _kernels():  # pages of whole key tiles
        with pytest.raises(ValueError, match="page_size=12: need a positive multiple of 16"):
            Engine(SPEC, GREEDY, slots=2, page_size=12)
    with pytest.raises(ValueError, match="pages: a list of 1 to 2 page ids in"):
        engine.prefill_insert({}, engine.init(), [], [], [0], [0], [0], [0], key=None, pages=[[9]])
    with pytest.raises(ValueError, match="insert_rows=-1: need at least 1"):
        Engine(SPEC, GREEDY, slots=2, insert_rows=-1)
    # A call inserts up to insert_rows rows (the default: a sixteenth of the slots, 1).
    with pytest.raises(ValueError, match=r"up to 1 rows per batch shard \(insert_rows=1 "):
        engine.prefill_insert(
            {}, engine.init(), [], [], [0, 1], [0, 0], [0, 1], [0, 0], key=None, pages=[[0], [1]]
        )
