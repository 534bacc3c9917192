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

A schedule is `(trainer, state, bar) -> state`: it threads the trainer's state
(`TrainerState`, plain data) through the phases and returns the last. `trainer` (the
`RLTrainer`) gives it what lives outside the state: the run's parts, the prompts
(`trainer.prompts`, a `PromptSource`), the sampler's copy of a state's policy
(`trainer.sampler_weights`) and `trainer.finish_step`, which logs a trained batch, runs
hooks, evaluates and checkpoints when due, and returns the state with the step
advanced. The stream of groups in flight is the pipeline schedules' own.
"""

from __future__ import annotations

import functools
import time

import jax

from rl_jax.sampling import Rollouts
from rl_jax.train import phases
from rl_jax.train.split import SplitStream
from rl_jax.train.state import Pending, TrainerState
from rl_jax.train.stream import trainer_stream


def on_policy(trainer, state: TrainerState, bar) -> TrainerState:
    """PPO-off-policy with k = 1: every batch is sampled with the weights that train on it."""
    return ppo_off_policy(trainer, state, bar, k=1)


def ppo_off_policy(trainer, state: TrainerState, bar, *, k: int | None = None) -> TrainerState:
    cfg, parts = trainer.cfg, trainer.parts
    k = cfg.train.off_policy_k if k is None else k
    while state.step < cfg.train.steps:
        if not state.pending:
            # The whole group of k batches with the current weights, before any update.
            t0 = time.perf_counter()
            weights, version = trainer.sampler_weights(state)
            if cfg.data.dynamic_sampling:
                state, rollouts, problems = phases.dynamic_rollout(
                    parts, state, trainer.prompts, weights
                )
                batches = [problems]
            else:
                n = min(k, cfg.train.steps - state.step)
                batches = [trainer.prompts.draw() for _ in range(n)]
                flat = [p for b in batches for p in b]
                rollouts = phases.generate(parts, weights, version, state.step, flat)
                state = phases.account_sampling(parts, state, rollouts)
            P, sample_s = parts.prompts_per_batch, time.perf_counter() - t0
            rows = P * parts.samples_per_prompt
            pending = tuple(
                Pending(
                    phases.rows_of(rollouts, i * rows, (i + 1) * rows, i * P),
                    problems=b,
                    sample_s=sample_s if i == 0 else 0.0,
                )
                for i, b in enumerate(batches)
            )
            state = state.replace(pending=pending)
        head = state.pending[0]
        # The rest of the group stays pending: no checkpoint until it is trained.
        state = state.replace(pending=state.pending[1:])
        t1 = time.perf_counter()
        state, m = _train(trainer, state, head.rollouts, head.problems)
        state = _finish(trainer, state, m, head.sample_s, t1, bar, in_flight=bool(state.pending))
    return state


def pipeline(trainer, state: TrainerState, bar) -> TrainerState:
    """PipelineRL-k as a continuous stream on the engine (rl_jax.train.stream): the
    trainer takes the next B_p complete groups; the groups in flight continue with the
    new weights. The stream starts empty (a fresh run, or resumed: nothing in flight)."""
    cfg, parts = trainer.cfg, trainer.parts
    stream = trainer_stream(parts, trainer.prompts, state.step)
    while state.step < cfg.train.steps:
        t0 = time.perf_counter()
        # Groups only for steps before the next checkpoint: the stream drains there.
        stream.allow(min(cfg.train.steps, trainer.next_boundary(state.step)))
        if stream.idle:  # drained (the start, a checkpoint): counted afresh, as on resume
            stream.count_afresh()
        problems, rollouts = stream.next_batch(functools.partial(trainer.sampler_weights, state))
        state = phases.account_sampling(parts, state, rollouts)
        sample_s, t1 = time.perf_counter() - t0, time.perf_counter()
        state, m = _train(trainer, state, rollouts, problems)
        stream.trained()
        m["train/slot_occupancy"] = stream.occupancy  # since the stream last drained
        state = _finish(trainer, state, m, sample_s, t1, bar, in_flight=not stream.idle)
    return state


def split(trainer, state: TrainerState, bar) -> TrainerState:
    """PipelineRL-k with the sampler on its own devices (rl_jax.train.split): the stream
    on the engine decodes in `SplitStream`'s thread while the trainer trains."""
    cfg, parts = trainer.cfg, trainer.parts
    stream = trainer_stream(parts, trainer.prompts, state.step)
    worker = SplitStream(stream, weights=trainer.sampler_weights(state))
    trainer.split_sampler = worker  # for step hooks (tests, tools)
    try:
        worker.allow(min(cfg.train.steps, trainer.next_boundary(state.step)))
        while state.step < cfg.train.steps:
            t0 = time.perf_counter()
            step, problems, rollouts = worker.take()
            assert step == state.step, (step, state.step)
            state = phases.account_sampling(parts, state, rollouts)
            wait_s, t1 = time.perf_counter() - t0, time.perf_counter()
            state, m = _train(trainer, state, rollouts, problems)
            # Push before `trained`: a group admitted after it samples with these
            # weights (the staleness bound in rl_jax.train.split relies on it).
            worker.push(trainer.sampler_weights(state))
            worker.trained()
            worker.train_intervals.append((t1, time.perf_counter()))
            # sample_s: the wait for rollouts
            state = _finish(trainer, state, m, wait_s, t1, bar, in_flight=not stream.idle)
            worker.allow(min(cfg.train.steps, trainer.next_boundary(state.step)))
    finally:
        worker.close()
    return state


# train.off_policy -> its schedule (split mode, mesh.sampler_devices > 0, runs `split`).
SCHEDULES = {"on_policy": on_policy, "ppo_off_policy": ppo_off_policy, "pipeline": pipeline}


def _train(trainer, state: TrainerState, rollouts: Rollouts, problems) -> tuple[TrainerState, dict]:
    """score -> advantages -> update on one batch: (new state, step metrics)."""
    t0 = time.perf_counter()
    trainer.weights.drop_view()  # the update makes a new version: its memory goes to the update
    scores = phases.score(trainer.parts, rollouts, problems)
    trainer.log_samples(state.step + 1, problems, scores)
    score_s = time.perf_counter() - t0
    state, m = phases.train_on(trainer.parts, state, trainer.prompts, rollouts, problems, scores)
    m["time/score_s"] = score_s
    return state, m


def _finish(trainer, state, m: dict, sample_s: float, t1: float, bar, *, in_flight: bool):
    m["time/sample_s"] = sample_s
    m["time/step_s"] = time.perf_counter() - t1 + sample_s
    state = state.count(device_seconds=m["time/step_s"] * jax.device_count())
    return trainer.finish_step(state, m, bar, in_flight=in_flight)
