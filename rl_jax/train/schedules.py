"""The off-policy modes (ScaleRL section 3.1) as schedules over the phases.

  on_policy       generate B_p x n rows with the current weights, take M updates.
  ppo_off_policy  generate k batches with the current weights, then train on
                  them one after another (k x M updates on increasingly stale data).
  pipeline        PipelineRL-k as a continuous stream of groups on the engine
                  (`rl_jax.train.stream`): a group (one prompt, n rows) enters the
                  engine's slots as they free up, a batch is the next B_p complete
                  groups, and the trainer's M updates reach every later decode chunk:
                  rows in flight continue with the new weights on a stale KV cache,
                  every token records the policy version that sampled it. At most
                  W = (k + 1) // U batches are untrained at once (U: a batch's
                  optimizer steps, `accounting.policy_steps`), which keeps every
                  update within k optimizer steps of the oldest token it trains on.
  split           pipeline with the engine on the sampler's own devices, decoding in
                  a background thread while the rest train (`rl_jax.train.split`).

A schedule drives a trainer `tr` (`RLTrainer`): it reads `tr.state`, runs phases,
sets `tr.state`, and hands every trained batch to `tr.finish_step` (logging,
hooks, evaluation, checkpoints), which advances the step.
"""

from __future__ import annotations

import time

import jax

from rl_jax.sampling import Rollouts
from rl_jax.train import phases
from rl_jax.train.split import SplitStream
from rl_jax.train.state import Pending
from rl_jax.train.stream import trainer_stream


def on_policy(tr, bar) -> None:
    """PPO-off-policy with k = 1: every batch is sampled with the weights that train on it."""
    ppo_off_policy(tr, bar, k=1)


def ppo_off_policy(tr, bar, *, k: int | None = None) -> None:
    cfg, parts = tr.cfg, tr.parts
    k = cfg.train.off_policy_k if k is None else k
    while tr.state.step < cfg.train.steps:
        if not tr.state.pending:
            # The whole group of k batches with the current weights, before any update.
            t0 = time.perf_counter()
            if cfg.data.dynamic_sampling:
                tr.state, ro, problems = phases.dynamic_rollout(
                    parts, tr.state, tr.sampler_weights()[0]
                )
                batches = [problems]
            else:
                n = min(k, cfg.train.steps - tr.state.step)
                batches = [tr.state.data.draw() for _ in range(n)]
                flat = [p for b in batches for p in b]
                ro = phases.generate(parts, *tr.sampler_weights(), tr.state.step, flat)
                tr.state = phases.account_sampling(parts, tr.state, ro)
            rows, sample_s = parts.P * parts.G, time.perf_counter() - t0
            pending = tuple(
                Pending(
                    phases.rows_of(ro, i * rows, (i + 1) * rows, i * parts.P),
                    problems=b,
                    sample_s=sample_s if i == 0 else 0.0,
                )
                for i, b in enumerate(batches)
            )
            tr.state = tr.state.replace(pending=pending)
        head = tr.state.pending[0]
        # The rest of the group stays pending: no checkpoint until it is trained.
        tr.state = tr.state.replace(pending=tr.state.pending[1:])
        t1 = time.perf_counter()
        state, m = _train(tr, head.rollouts, head.problems)
        _finish(tr, state, m, head.sample_s, t1, bar)


def pipeline(tr, bar) -> None:
    """PipelineRL-k as a continuous stream on the engine (rl_jax.train.stream): the
    trainer takes the next B_p complete groups; the groups in flight continue with the
    new weights."""
    cfg, parts = tr.cfg, tr.parts
    if tr.state.stream is None:  # a fresh run, or resumed: nothing in flight
        tr.state = tr.state.replace(stream=trainer_stream(parts, tr.state.data, tr.state.step))
    stream = tr.state.stream
    while tr.state.step < cfg.train.steps:
        t0 = time.perf_counter()
        # Groups only for steps before the next checkpoint: the stream drains there.
        stream.allow(min(cfg.train.steps, tr.next_boundary()))
        if stream.idle:  # drained (the start, a checkpoint): counted afresh, as on resume
            stream.count_afresh()
        problems, ro = stream.next_batch(tr.sampler_weights)
        tr.state = phases.account_sampling(parts, tr.state, ro)
        sample_s, t1 = time.perf_counter() - t0, time.perf_counter()
        state, m = _train(tr, ro, problems)
        stream.trained()
        m["train/slot_occupancy"] = stream.occupancy  # since the stream last drained
        _finish(tr, state, m, sample_s, t1, bar)


def split(tr, bar) -> None:
    """PipelineRL-k with the sampler on its own devices (rl_jax.train.split): the stream
    on the engine decodes in `SplitStream`'s thread while the trainer trains."""
    cfg, parts = tr.cfg, tr.parts
    stream = trainer_stream(parts, tr.state.data, tr.state.step)
    tr.state = tr.state.replace(stream=stream)
    worker = SplitStream(stream, weights=tr.sampler_weights())
    tr.split_sampler = worker
    try:
        worker.allow(min(cfg.train.steps, tr.next_boundary()))
        while tr.state.step < cfg.train.steps:
            t0 = time.perf_counter()
            step, problems, ro = worker.take()
            assert step == tr.state.step, (step, tr.state.step)
            tr.state = phases.account_sampling(parts, tr.state, ro)
            wait_s, t1 = time.perf_counter() - t0, time.perf_counter()
            state, m = _train(tr, ro, problems)
            tr.state = state
            # Push before `trained`: a group admitted after it samples with these
            # weights (the staleness bound in rl_jax.train.split relies on it).
            worker.push(tr.sampler_weights())
            worker.trained()
            worker.train_intervals.append((t1, time.perf_counter()))
            _finish(tr, state, m, wait_s, t1, bar)  # sample_s: the wait for rollouts
            worker.allow(min(cfg.train.steps, tr.next_boundary()))
    finally:
        worker.close()


# train.off_policy -> its schedule (split mode, mesh.sampler_devices > 0, runs `split`).
SCHEDULES = {"on_policy": on_policy, "ppo_off_policy": ppo_off_policy, "pipeline": pipeline}


def _train(tr, ro: Rollouts, problems):
    """score -> advantages -> update on one batch: (new state, step metrics)."""
    t0 = time.perf_counter()
    tr.weights.drop_view()  # the update makes a new version: its memory goes to the update
    scores = phases.score(tr.parts, ro, problems)
    tr.log_samples(problems, scores)
    score_s = time.perf_counter() - t0
    state, m = phases.train_on(tr.parts, tr.state, ro, problems, scores)
    m["time/score_s"] = score_s
    return state, m


def _finish(tr, state, m: dict, sample_s: float, t1: float, bar) -> None:
    m["time/sample_s"] = sample_s
    m["time/step_s"] = time.perf_counter() - t1 + sample_s
    state = state.count(device_seconds=m["time/step_s"] * jax.device_count())
    tr.finish_step(state, m, bar)
