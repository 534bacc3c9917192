"""The RL loop: sample -> score -> advantages -> filters -> M updates -> push weights.

`RLTrainer` is the shell around three pure-ish pieces: the run's unchanging
`Parts` (rl_jax.train.parts), one `TrainerState` (rl_jax.train.state: exactly
what a checkpoint holds) and the phases (rl_jax.train.phases) that map a state
to the next. The off-policy mode picks a schedule over the phases
(rl_jax.train.schedules); the shell logs, evaluates, checkpoints and resumes.

One "step" is one batch of B_p prompts trained with M minibatch updates (M /
train.grad_accum optimizer steps); the policy version counts minibatch updates,
PipelineRL's staleness optimizer steps. Random keys derive from (seed, step),
so a resumed run repeats the numbers of one that never stopped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rl_jax.config import RunConfig, flatten, resolved, run_id
from rl_jax.data import Curriculum, PromptPipeline
from rl_jax.runs import RunDir, create_run_dir, progress_bar
from rl_jax.runs import run_dir as runs_lib
from rl_jax.runs.storage import check_out_dir
from rl_jax.sharding import start_jax
from rl_jax.train import phases, schedules
from rl_jax.train.params import LORA_KEY
from rl_jax.train.parts import (
    SamplerWeights,
    adapter_key,
    build_parts,
    copy_params,
    init_opt_state,
)
from rl_jax.train.record import Recorder, curve_row, say
from rl_jax.train.split import SplitStream
from rl_jax.train.state import PromptSource, TrainerState


class NonFiniteError(RuntimeError):
    """Too many consecutive NaN/Inf updates; the run stopped after a checkpoint."""


class RLTrainer:
    """Builds everything a RunConfig names and runs it into its run directory."""

    def __init__(self, cfg: RunConfig, *, run_root: str | Path | None = None, quiet: bool = False):
        cfg = resolved(cfg)  # knobs left to the loss's defaults, filled in once for every part
        start_jax(cfg.mesh)
        self.cfg = cfg
        self.is_main = jax.process_index() == 0
        # Progress and evaluation lines (the start, resume and end lines are always said).
        self.talk = cfg.logging.progress and not quiet and self.is_main
        self.run_id = run_id(cfg)
        root = runs_lib.run_root(cfg, run_root)
        check_out_dir(root, "out_dir" if run_root is None else "--run-dir")
        # A directory that exists is locked first, so a busy or foreign one is refused
        # before any device work; a new one is created only once the config has built,
        # so a config that fails to build leaves nothing behind.
        fresh = not runs_lib.run_exists(root)
        self.run: RunDir | None = None
        if not fresh:
            self.run = create_run_dir(cfg, run_root, lock=self.is_main, write=False)
        try:
            self._build(cfg)
            if fresh:
                self.run = create_run_dir(cfg, run_root, lock=self.is_main, write=False)
            self._open(cfg)
        except BaseException:
            if self.run is not None:
                self.run.close()
            raise

    def _build(self, cfg: RunConfig) -> None:
        self.parts, params, opt_state = build_parts(cfg)
        # Every process holds the same global batch of prompts (they are tiny): the
        # sampler shards rows over the global mesh and rewards are scored everywhere.
        curriculum = Curriculum(cfg.data)
        prompts = PromptPipeline(
            self.parts.task.train,
            batch_size=cfg.data.prompts_per_batch,
            seed=cfg.data.seed,
            curriculum=curriculum,
            process_index=0,
            process_count=1,
        )
        self.prompts = PromptSource(prompts, curriculum)
        self.state = TrainerState(
            params=params,
            opt_state=opt_state,
            # The reference policy is the initial one, frozen (sharded like the policy).
            ref_params=copy_params(params) if cfg.loss.kl_coef > 0 else None,
        )
        self.knobs = flatten(cfg)
        self.weights = SamplerWeights(self.parts)  # the sampler's copies of the policy
        self.split_sampler: SplitStream | None = None  # split mode's sampler thread
        self.in_flight = False  # sampler work in flight after the last step (finish_step)
        self.step_hooks: list = []  # callables(trainer) run after every step (tests, tools)
        self._resumed: bool | None = None  # try_resume's answer, once asked

    def _open(self, cfg: RunConfig) -> None:
        """Once the run directory is locked: its config, checkpoints and rows."""
        if self.is_main:
            self.run.write_config(cfg)
            say(f"run directory: {self.run.url()}")
        self.record = Recorder(cfg, self.run, run_id=self.run_id, is_main=self.is_main)

    ckpt = property(lambda self: self.record.ckpt)
    # The state's and the parts' names that callers (CLI, benchmarks, tests) read.
    step = property(lambda self: self.state.step)
    version = property(lambda self: self.state.version)
    params = property(lambda self: self.state.params)
    counters = property(lambda self: self.state.counters)
    curriculum = property(lambda self: self.prompts.curriculum)
    spec = property(lambda self: self.parts.spec)
    tokenizer = property(lambda self: self.parts.tokenizer)
    task = property(lambda self: self.parts.task)
    correct_fn = property(lambda self: self.parts.correct_fn)
    mesh = property(lambda self: self.parts.mesh)
    sample_mesh = property(lambda self: self.parts.sample_mesh)
    split = property(lambda self: self.parts.split)
    lr_schedule = property(lambda self: self.parts.lr_schedule)
    prompts_per_batch = property(lambda self: self.parts.prompts_per_batch)
    samples_per_prompt = property(lambda self: self.parts.samples_per_prompt)

    def set_initial_params(self, host_params: dict) -> None:
        """Start from these weights (e.g. a supervised warm-up) instead of the random init:
        the state is made from them as at the start (plan.init_state: fresh adapters)."""
        p = self.parts
        params = {k: v for k, v in self.state.params.items() if k != LORA_KEY}
        missing = sorted(set(params) - set(host_params))
        if missing:
            raise ValueError(f"initial params lack tensors {missing}")
        for k, v in params.items():
            if tuple(np.shape(host_params[k])) != tuple(v.shape):
                raise ValueError(
                    f"initial param {k!r} has shape {np.shape(host_params[k])}, "
                    f"model needs {v.shape}"
                )
        params = {
            k: jax.device_put(np.asarray(host_params[k], v.dtype), v.sharding)
            for k, v in params.items()
        }
        params = p.param_format.init_state(params, key=adapter_key(p.cfg), mesh=p.mesh)
        self.weights.reset()
        self.state = self.state.replace(
            params=params,
            opt_state=init_opt_state(p.tx, p.mesh, params, p.param_format),
            ref_params=None if self.state.ref_params is None else copy_params(params),
        )

    def sampler_weights(self, state: TrainerState | None = None) -> tuple[Any, int]:
        """(weights, version) of `state`'s policy (by default the trainer's) for the
        sampler (SamplerWeights: the policy's view; in split mode a copy on the sampler's
        devices), made once per version."""
        state = self.state if state is None else state
        return self.weights.sampler(state.params, state.version)

    def policy_weights(self) -> dict[str, jax.Array]:
        """The policy's weights as the model runs them (`plan.view` of the state)."""
        return self.weights.policy(self.state.params, self.state.version)

    # ---- the loop -------------------------------------------------------------------------

    def run_loop(self) -> dict[str, Any]:
        try:
            return self._run_loop()
        finally:
            self.close()

    def _run_loop(self) -> dict[str, Any]:
        cfg = self.cfg
        done = self.run.read_done() if cfg.checkpoint.resume else None
        if done is not None:
            self.record.already_done(done)
            return done
        resumed = self.try_resume()
        self.record.open_logs(knobs=self.knobs, purge_step=self.step + 1 if resumed else 0)
        if not resumed and cfg.eval.at_start:
            self._maybe_eval(force=True)
        schedule = schedules.split if self.split else schedules.SCHEDULES[cfg.train.off_policy]
        name = f"train {cfg.name}"
        with progress_bar(cfg.train.steps, name, enabled=self.talk, completed=self.step) as bar:
            self.state = schedule(self, self.state, bar)
        self.save(force=True)
        st = self.state
        summary = {
            "run_id": self.run_id,
            "steps": st.step,
            "version": st.version,
            "counters": st.counters.as_dict(),
            "staleness_hist": {str(k): v for k, v in sorted(st.staleness_hist.items())},
        }
        self.record.finish(summary)
        return summary

    def finish_step(
        self, state: TrainerState, metrics: dict[str, float], bar, *, in_flight: bool
    ) -> TrainerState:
        """A trained batch's state: the step advances, then logs, hooks, evaluation and
        the checkpoint when due (never with sampler work `in_flight`: a checkpoint then
        would not resume exactly). Returns the state the schedule goes on with."""
        self.state = state.replace(step=state.step + 1)
        self.in_flight = in_flight
        self.record.stepped()  # a lost lock or a failed background save stops the run here
        self.record.log(self.step, metrics)
        for hook in self.step_hooks:
            hook(self)
        streak, limit = self.state.nonfinite_streak, self.cfg.train.max_nonfinite
        if streak >= limit:
            self.save(force=True)
            self.ckpt.wait()
            raise NonFiniteError(
                f"{streak} consecutive updates had NaN/Inf loss or gradients "
                f"(train.max_nonfinite={limit}); stopped at step "
                f"{self.step} with a checkpoint in {self.run.checkpoints_dir}"
            )
        ev = self._maybe_eval(force=self.step == self.cfg.train.steps)
        if not in_flight and self._ckpt_due():
            self.save()
        info = f"reward {metrics.get('train/reward', float('nan')):+.3f}"
        if ev is not None:
            info += f"  val pass@1 {ev['val/pass@1']:.3f}"
        bar.advance(info=info)
        return self.state

    def next_boundary(self, step: int) -> int:
        """The next step after `step` a checkpoint is due at (the last step without
        checkpoints)."""
        every = self.cfg.checkpoint.every
        if every <= 0:
            return self.cfg.train.steps
        return (step // every + 1) * every

    # ---- logging and evaluation -----------------------------------------------------------

    def log_samples(self, step: int, problems, scores: phases.Scores) -> None:
        """A few readable rows of the batch logged under `step` (Recorder.log_samples)."""
        well_formed = self.parts.reward_fn.well_formed
        self.record.log_samples(step, problems, scores, well_formed=well_formed)

    def evaluate(self) -> dict[str, float]:
        self.state, m = phases.evaluate(self.parts, self.state, self.sampler_weights()[0])
        return m

    def _maybe_eval(self, force: bool = False) -> dict[str, float] | None:
        every = self.cfg.eval.every
        if not (force or (every > 0 and self.step % every == 0)):
            return None
        if self.talk:
            ev = self.cfg.eval
            n = len(self.parts.val_problems)
            say(f"evaluating step {self.step}: {n} prompts x {ev.k} samples ...")
        t0 = time.perf_counter()
        m = self.evaluate()
        if self.talk:
            first = self.record.first_eval
            was = "" if first is None else f" (first evaluation {first:.3f})"
            say(
                f"step {self.step}: val pass@1 {m['val/pass@1']:.3f}{was}"
                f" [{time.perf_counter() - t0:.0f} s]"
            )
        row = curve_row(
            run_id=self.run_id,
            recipe=self.cfg.recipe or self.cfg.name,
            knobs=self.knobs,
            state=self.state,
            curriculum=self.prompts.curriculum,
            metrics=m,
        )
        self.record.evaluated(self.step, row, m)
        return m

    # ---- checkpoints ----------------------------------------------------------------------

    def _ckpt_due(self) -> bool:
        """Due once a multiple of checkpoint.every has been reached since the newest
        checkpoint (`finish_step` asks only with no sampler work in flight: a
        PPO-off-policy-k group checkpoints at its end, since inside it a resume would
        sample the group's remaining batches with newer weights)."""
        every = self.cfg.checkpoint.every
        if every <= 0:
            return False
        return self.step // every > max(self.ckpt.steps(), default=0) // every

    def save(self, *, force: bool = False) -> None:
        meta = {**self.state.meta(), **self.prompts.state_dict()}
        self.record.save(self.step, self.state.arrays(), meta, force=force)

    def try_resume(self) -> bool:
        """Restore the newest usable checkpoint, or start over; either way the logs are
        rewound to the restored step (to nothing when starting over), so a rerun after a
        kill at any moment writes exactly the rows of a run that never stopped.

        Decided once: later calls return the first answer (callers that prepare a fresh
        start, such as a supervised warm-up, ask before `run_loop` does)."""
        if self._resumed is None:
            self._resumed = self._try_resume()
        return self._resumed

    def _try_resume(self) -> bool:
        got = self.record.restore(self.state.arrays())
        if got is None:
            return False
        _, arrays, meta = got
        self.prompts.load_state_dict(meta)
        self.state = self.state.restored(arrays, meta)
        self.weights.reset()
        return True

    def compile_counts(self) -> dict[str, int]:
        """Compiled variants of every jitted function (a recompilation makes one grow)."""
        p = self.parts
        fns = {"train_step": p.update_fn, "logprob": p.logprob_fn}
        counts = {k: int(f._cache_size()) for k, f in fns.items()}
        for prefix, engine in (("engine", p.engine), ("eval", p.eval_sampler)):
            counts.update({f"{prefix}_{k}": n for k, n in engine.compile_counts().items()})
        return counts

    def close(self) -> None:
        """Finish pending saves and release the run directory (idempotent)."""
        if getattr(self, "record", None) is not None:
            self.record.close()
        elif self.run is not None:
            self.run.close()


def train(cfg: RunConfig, *, run_root: str | Path | None = None, quiet: bool = False) -> dict:
    return RLTrainer(cfg, run_root=run_root, quiet=quiet).run_loop()
