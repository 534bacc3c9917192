"""PipelineRL's continuous stream (rl_jax.train.stream): admission, deadlines and the
per-token staleness check by hand, a randomized run of the whole protocol, and the
stream on the engine (test_sampler's small random model)."""

from types import SimpleNamespace

import numpy as np
import pytest

from rl_jax.train.accounting import batches_in_flight
from rl_jax.train.phases import StalenessError, check_staleness
from rl_jax.train.stream import DeadlineError, StreamBook, feasible

# ---- the book, by hand --------------------------------------------------------------------


def test_feasible_is_earliest_deadline_first_with_P_per_batch():
    assert feasible([], 3, 2)
    assert feasible([0, 0, 1, 1], 0, 2)
    assert not feasible([0, 0, 0], 0, 2)  # three due in batch 0 of two
    assert feasible([2, 0, 1, 1], 0, 2)  # order does not matter
    assert not feasible([1, 1, 1, 1, 1], 0, 2)  # five due by batch 1: four fit
    assert not feasible([0], 1, 2)  # due before the first batch left


def test_admission_keeps_at_most_W_batches_untrained():
    book = StreamBook(P=2, W=3)
    book.allow(100)
    got = []
    while book.can_admit():
        got.append(book.admit())
    assert got == [0, 1, 2, 3, 4, 5]  # the batch being formed and (W - 1) x P ahead
    assert [book.groups[g].deadline for g in got] == [2] * 6
    with pytest.raises(DeadlineError, match="admitted past"):
        book.admit()
    for g in (4, 1):
        book.complete(g)
    assert book.take() == [4, 1]  # completion order: the stream does not wait for 0
    assert not book.can_admit()  # formed, not yet trained: still untrained
    book.trained_one()
    assert [book.admit(), book.admit()] == [6, 7]
    assert book.groups[6].deadline == 3 and not book.can_admit()


def test_a_batch_waits_for_the_group_due_in_it():
    book = StreamBook(P=2, W=2)
    book.allow(100)
    assert [book.admit() for _ in range(4)] == [0, 1, 2, 3]  # due by batch 1
    book.complete(2)
    assert book.take() is None  # one complete group of the two a batch needs
    book.complete(3)
    assert book.take() == [2, 3]
    book.trained_one()
    assert [book.admit(), book.admit()] == [4, 5]  # due by batch 2
    book.complete(5)
    book.complete(4)
    # 4 and 5 are complete, but 0 and 1 are due in batch 1: it waits for them.
    assert book.take() is None
    book.complete(0)
    assert book.take() is None  # 1 still in flight, and due now
    book.complete(1)
    assert book.take() == [0, 1]  # due first, though 4 and 5 ended sooner
    book.trained_one()
    assert book.take() == [5, 4]
    book.trained_one()
    assert book.idle


def test_allow_drains_the_stream_at_a_checkpoint():
    book = StreamBook(P=2, W=3, first_step=4)
    assert not book.can_admit()  # nothing allowed yet
    book.allow(5)  # checkpoint at step 5: only batch 4's groups
    assert [book.admit(), book.admit()] == [8, 9] and not book.can_admit()
    book.complete(9)
    book.complete(8)
    assert book.take() == [9, 8] and not book.idle
    book.trained_one()
    assert book.idle and book.trained == 5


def test_training_a_batch_not_formed_is_refused():
    book = StreamBook(P=1, W=1)
    with pytest.raises(DeadlineError, match="before it was formed"):
        book.trained_one()
    with pytest.raises(ValueError, match="W >= 1"):
        StreamBook(P=1, W=0)


@pytest.mark.parametrize("seed", range(8))
def test_random_completions_keep_every_deadline_and_the_staleness_bound(seed):
    """The protocol against random completion orders: every batch has P groups, every
    group is trained by its deadline, and per token (version = t x M at admission) no
    update runs on weights more than k optimizer steps ahead: M minibatch updates per
    batch, train.grad_accum of them per step, U = M / grad_accum steps per batch."""
    rng = np.random.default_rng(seed)
    P, U, ga = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(1, 4))
    M, W = U * ga, int(rng.integers(1, 4))
    k = W * U - 1 + int(rng.integers(0, U))
    knobs = dict(off_policy_k=k, updates_per_batch=M, grad_accum=ga, pipeline_waves=0)
    cfg = SimpleNamespace(train=SimpleNamespace(**knobs))  # k = 0 is below the knob's range
    assert batches_in_flight(cfg) == W  # (k + 1) // U
    book = StreamBook(P=P, W=W)
    steps = 12
    book.allow(steps)
    version_at: dict[int, int] = {}
    trained_at: dict[int, int] = {}
    flight: list[int] = []
    while book.trained < steps:
        while book.can_admit():
            g = book.admit()
            version_at[g] = book.trained * M
            flight.append(g)
        batch = book.take()
        if batch is None:
            g = flight.pop(int(rng.integers(len(flight))))
            book.complete(g)
            continue
        assert len(batch) == P
        for g in batch:
            trained_at[g] = book.trained
            last_update = book.trained * M + M - 1
            v = np.array([[version_at[g]]])
            check_staleness(v, np.array([[True]]), book.trained * M, M, k, ga)
            assert last_update // ga - version_at[g] // ga <= k
        book.trained_one()
    assert sorted(trained_at) == list(range(steps * P)) and book.idle


# ---- the staleness check ------------------------------------------------------------------


def test_check_staleness_per_token():
    versions = np.array([[4, 5, -1], [6, 6, 6]])
    mask = np.array([[True, True, False], [True, True, True]])
    # Updates at versions 6 and 7 (M = 2): the oldest token (4) is 3 behind the last.
    assert check_staleness(versions, mask, 6, 2, 3) == 3
    with pytest.raises(
        StalenessError, match=r"staleness 3 exceeds k=2 optimizer steps: row 0 token 0"
    ):
        check_staleness(versions, mask, 6, 2, 2)
    # Tokens the policy did not sample (-1: padding, injected) are not checked.
    assert check_staleness(versions, np.array([[False, True, False], [True] * 3]), 6, 2, 2) == 2
    assert check_staleness(versions, np.zeros_like(mask), 99, 1, 0) == 0
    # Two minibatch updates per optimizer step: versions 4-5 are the weights of step 2,
    # 6-7 of step 3; the update at version 7 runs on step 3, 1 step after token (4).
    assert check_staleness(versions, mask, 6, 2, 1, grad_accum=2) == 1
    with pytest.raises(StalenessError, match=r"staleness 1 exceeds k=0 optimizer steps"):
        check_staleness(versions, mask, 6, 2, 0, grad_accum=2)
    # Three per step: version 5 holds step 1's weights, the update at 6 runs on step 2's;
    # versions 3 and 5 are both step 1's.
    assert check_staleness(np.array([[5]]), np.array([[True]]), 6, 1, 1, grad_accum=3) == 1
    assert check_staleness(np.array([[3]]), np.array([[True]]), 5, 1, 0, grad_accum=3) == 0


# ---- the stream on the engine -------------------------------------------------------------


def _stream(engine, *, P, W, G, key, limits=None):
    import jax  # noqa: F401  (the engine's; imported here to keep the book tests light)
    from test_sampler import PROMPTS

    from rl_jax.train.stream import EngineStream

    def source(g):
        row_ids = g * G + np.arange(G)
        return g, PROMPTS[g % len(PROMPTS)], row_ids, None if limits is None else limits[g]

    return EngineStream(engine, StreamBook(P=P, W=W), n=G, key=key, source=source)


def test_stream_rows_are_the_engines_and_weights_swap_in_flight():
    """Six slots for W x P x n = 8 rows. With one set of weights every row is the
    one Engine.run samples for its key (slot and neighbours do not matter); with a new
    version after every batch, rows in flight continue on it, every token records its
    version and none is more than k = W x M - 1 behind its update."""
    import jax
    from test_engine import SAMPLED
    from test_sampler import PROMPTS, SPEC, _params

    from rl_jax.sampling import Engine

    P, W, G, steps = 2, 2, 2, 4
    engine = Engine(SPEC, SAMPLED, slots=6, chunk=3, pad_id=0, fixed_shapes=True)
    key = jax.random.key(7)
    a, b = _params(0), _params(1)
    # Lengths that differ (the random model emits no stop token): groups end out of order.
    limits = np.random.default_rng(0).integers(1, 5, (steps * P, G))
    limits[0] = SAMPLED.max_new_tokens  # the first group ends last of its batch's

    stream = _stream(engine, P=P, W=W, G=G, key=key, limits=limits)
    stream.allow(steps)
    batches = []
    for _ in range(steps):
        batches.append(stream.next_batch(lambda: (a, 0)))
        stream.trained()
    assert stream.idle and not stream.busy()
    groups = [g for got, _ in batches for g in got]
    assert sorted(groups) == list(range(steps * P))
    assert groups[:2] != [0, 1]  # batches are completion order, not admission order
    assert 0 in groups[:4]  # but group 0 is in the batch its deadline names
    ref, _ = engine.run(
        a,
        [PROMPTS[g % 3] for g in groups],
        n=G,
        key=key,
        row_ids=[g * G + s for g in groups for s in range(G)],
        max_new_tokens=limits[groups].reshape(-1),
    )
    ro = batches[0][1]
    for f in ("completion_tokens", "completion_mask", "logprobs", "lengths", "row_ids"):
        got = np.concatenate([getattr(r, f) for _, r in batches])
        np.testing.assert_array_equal(got, getattr(ref, f), err_msg=f)
    np.testing.assert_array_equal(ro.group_ids, np.repeat(np.arange(P), G))
    assert 0 < stream.occupancy <= 1

    stream = _stream(engine, P=P, W=W, G=G, key=key, limits=limits)
    stream.allow(steps)
    mixed = False
    for step in range(steps):
        version = step  # M = 1: one update per batch
        _, ro = stream.next_batch(lambda v=version: ((a, b)[v % 2], v))
        assert engine._prepared is None  # the decode layout goes before the update
        assert ro.versions[ro.completion_mask].max() <= version
        assert check_staleness(ro.versions, ro.completion_mask, step, 1, 1) <= 1
        mixed |= any(
            len(set(r[m])) > 1 for r, m in zip(ro.versions, ro.completion_mask, strict=True)
        )
        stream.trained()
    assert mixed  # some row continued under the next version (its stale KV kept)
    assert engine.compile_counts()["generate"] == 1
