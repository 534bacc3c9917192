"""The trainer's state: everything the next RL step depends on, as plain data.

`TrainerState` is what a checkpoint holds, less the prompts: the arrays (policy,
optimizer state, frozen reference policy) and the host part (step and version
counters, compute counters, the staleness histogram). Phases take a state and
return a new one (`dataclasses.replace`); schedules thread it through the phases
and return the last (`rl_jax.train.schedules`).

The host-side iterators are not in it: `PromptSource` (the prompt iterator and the
curriculum its draws read, advancing in place, its position saved beside the state
in a checkpoint) and PipelineRL's stream of groups on the engine, which its schedule
owns. In-flight sampler work is never in a checkpoint (a PPO-off-policy-k group's
sampled but untrained batches are `pending` here): every schedule saves only where
there is none (the stream admits no group past the next checkpoint, so it drains
there; a PPO group checkpoints at its end), so a resume samples those rows again
from (seed, step) exactly as the first run did.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

import jax

from rl_jax.data import Curriculum, PromptPipeline
from rl_jax.train.accounting import ComputeCounters

Params = dict[str, jax.Array]


@dataclass(frozen=True)
class Pending:
    """A sampled batch waiting for its updates (PPO-off-policy-k: the rest of a group)."""

    rollouts: Any  # Rollouts, P x G rows
    problems: list  # [P] Problem
    sample_s: float  # seconds spent sampling it (logged with its step)


class PromptSource:
    """The prompt iterator and the curriculum its draws read, behind one lock (split
    mode draws prompts in the sampler thread while the trainer updates the curriculum).

    Host-side and advancing in place; `state_dict` and `load_state_dict` are what a
    checkpoint saves and restores of it."""

    def __init__(self, pipeline: PromptPipeline, curriculum: Curriculum):
        self.pipeline = pipeline
        self.curriculum = curriculum
        self.lock = threading.RLock()

    def draw(self) -> list:
        with self.lock:
            return next(self.pipeline)

    def record(self, ids: list, raw_pg) -> None:
        """Verifier rewards [P, G] of prompts `ids` into the curriculum's history."""
        with self.lock:
            self.curriculum.update(ids, raw_pg)

    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            return {
                "pipeline": self.pipeline.get_state(),
                "curriculum": self.curriculum.state_dict(),
            }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        with self.lock:
            self.pipeline.set_state(d["pipeline"])
            self.curriculum.load_state_dict(d["curriculum"])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainerState:
    params: Params  # the policy, on the trainer's mesh
    opt_state: Any
    ref_params: Params | None  # the frozen reference policy (loss.kl_coef > 0), else None
    step: int = 0  # RL steps (batches of P prompts) trained
    version: int = 0  # minibatch updates taken (train.grad_accum per optimizer step)
    nonfinite_streak: int = 0  # consecutive steps with a NaN/Inf update
    counters: ComputeCounters = field(default_factory=ComputeCounters)
    staleness_hist: dict[int, int] = field(default_factory=dict)  # {staleness: updates}
    # In flight, never checkpointed (see the module docstring).
    pending: tuple[Pending, ...] = ()  # ppo_off_policy: the group's untrained batches

    def replace(self, **changes) -> TrainerState:
        return dataclasses.replace(self, **changes)

    def count(self, **inc: float) -> TrainerState:
        """The state with compute counters increased by `inc`."""
        c = dataclasses.replace(self.counters)
        c.add(**inc)
        return self.replace(counters=c)

    # ---- checkpoints --------------------------------------------------------------------

    def arrays(self) -> dict[str, Any]:
        """The device part of a checkpoint."""
        st = {"params": self.params, "opt_state": self.opt_state}
        if self.ref_params is not None:
            st["ref_params"] = self.ref_params
        return st

    def meta(self) -> dict[str, Any]:
        """The state's host part of a checkpoint (JSON); the prompts' position goes beside
        it (`PromptSource.state_dict`)."""
        return {
            "step": self.step,
            "version": self.version,
            "counters": self.counters.as_dict(),
            "nonfinite_streak": self.nonfinite_streak,
            "staleness_hist": {str(k): v for k, v in self.staleness_hist.items()},
        }

    def restored(self, arrays: dict[str, Any], meta: dict[str, Any]) -> TrainerState:
        """This state with a checkpoint's arrays and meta."""
        return self.replace(
            params=arrays["params"],
            opt_state=arrays["opt_state"],
            ref_params=arrays.get("ref_params", self.ref_params),
            step=int(meta["step"]),
            version=int(meta["version"]),
            counters=ComputeCounters.from_dict(meta["counters"]),
            nonfinite_streak=int(meta["nonfinite_streak"]),
            staleness_hist={int(k): v for k, v in meta["staleness_hist"].items()},
            pending=(),
        )
