"""PipelineRL-k as a continuous stream on the engine: how `train.off_policy=pipeline`
(and split mode) samples.

Groups (one prompt, n rows) enter the engine's slots as slots free up, and a batch
is the next B_p groups to complete; the trainer's updates reach every later chunk,
rows in flight included (PipelineRL's in-flight update: their stale KV is kept).
A slot whose row ended takes the next row at once, where a batch decoded as one
block would hold its slots until its longest row ends.

Staleness bound, in optimizer steps (PipelineRL's k). W = `accounting.batches_in_flight`
batches may be untrained at once: the one being formed and (W - 1) x B_p groups ahead
of it. A batch's M minibatch updates take U optimizer steps (`accounting.policy_steps`:
M / train.grad_accum, or M). A group admitted when t batches are trained samples with
weights of version >= t x M, t x U steps (weights are read in the same critical
section as t) and gets the deadline t + W - 1: it must be in batch t + W - 1 or
earlier, whose last update runs on weights of (t + W) x U - 1 <= t x U + k steps. So
no token is more than k steps older than an update that trains on it; every token
records its version and `phases.check_staleness` checks each one.

Deadlines are kept by two rules (`StreamBook`, unit jobs of B_p per step, earliest
deadline first): a group is admitted only if every batch can still meet its groups'
deadlines with it (at most (b - f + 1) x B_p unformed groups due by batch b, f the
batch being formed), and a batch takes the B_p complete groups due first (ties:
completion order) only if the groups left can still meet theirs; else the engine
decodes on until the group due now completes.

Checkpoints drain the stream: groups are admitted only for batches before the next
checkpoint (`allow`), so at a checkpoint nothing is in flight and a resume samples
the next groups from (seed, step) exactly as a run that never stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rl_jax.sampling import ChunkOut, Engine, Rollouts
from rl_jax.sampling._decoder import state_rollouts
from rl_jax.sampling._slots import COLUMNS, SlotBook

Weights = tuple[Any, int]  # (params in the sampler's layout, policy version)


class DeadlineError(RuntimeError):
    """The stream's bookkeeping broke the staleness bound it exists to keep (a bug)."""


def feasible(deadlines, first: int, per_batch: int) -> bool:
    """Whether groups with these deadlines fit batches first, first + 1, ... of
    `per_batch` groups each, every group in a batch at or before its deadline (earliest
    deadline first: the i-th earliest goes into batch first + i // per_batch)."""
    d = np.sort(np.asarray(list(deadlines), np.int64))
    return bool(np.all(d >= first + np.arange(d.size) // per_batch))


@dataclass
class _Group:
    deadline: int  # the last batch that may train it
    done_seq: int = -1  # completion order; -1 while rows are in flight


class StreamBook:
    """Which groups may enter the engine and which form the next batch: host
    bookkeeping only (the engine's work is `EngineStream`'s).

    P: groups per batch (B_p); W: batches untrained at once (`batches_in_flight`). Groups
    are numbered in admission order from first_step x P; batches from first_step.
    """

    def __init__(self, *, P: int, W: int, first_step: int = 0):
        if P < 1 or W < 1:
            raise ValueError(f"need P >= 1 and W >= 1, got P={P}, W={W}")
        self.P, self.W = int(P), int(W)
        self.trained = int(first_step)  # batches trained (their weights pushed)
        self.formed = int(first_step)  # batches handed out: formed - trained await training
        self.admitted = self.trained * self.P  # the next group's index
        self.limit = self.admitted  # groups below this index may be admitted (`allow`)
        self.groups: dict[int, _Group] = {}  # admitted, in no batch yet
        self._seq = 0

    def allow(self, step: int) -> None:
        """Groups of batches below `step` may be admitted (the next checkpoint, or the
        last step)."""
        self.limit = max(self.limit, int(step) * self.P)

    def can_admit(self) -> bool:
        if self.admitted >= self.limit:
            return False
        due = [g.deadline for g in self.groups.values()]
        return feasible([*due, self.trained + self.W - 1], self.formed, self.P)

    def admit(self) -> int:
        """A new group (its index), due by batch trained + W - 1."""
        if not self.can_admit():
            raise DeadlineError(
                f"group {self.admitted} admitted past the limit or the deadlines "
                f"(trained {self.trained}, formed {self.formed}, limit {self.limit})"
            )
        g = self.admitted
        self.groups[g] = _Group(deadline=self.trained + self.W - 1)
        self.admitted += 1
        return g

    def complete(self, g: int) -> None:
        """Every row of group g has ended."""
        self.groups[g].done_seq = self._seq
        self._seq += 1

    def take(self) -> list[int] | None:
        """The next batch's groups (deadline, then completion order), or None while it
        cannot be formed: fewer than P groups complete, or one due in it still in
        flight."""
        groups = self.groups.items()
        done = sorted((x.deadline, x.done_seq, g) for g, x in groups if x.done_seq >= 0)
        if len(done) < self.P:
            return None
        chosen = [g for _, _, g in done[: self.P]]
        late = [d for d, _, _ in done[: self.P] if d < self.formed]
        if late:
            raise DeadlineError(f"batch {self.formed} takes groups due by batch {min(late)}")
        rest = [x.deadline for g, x in self.groups.items() if g not in set(chosen)]
        if not feasible(rest, self.formed + 1, self.P):
            return None
        for g in chosen:
            del self.groups[g]
        self.formed += 1
        return chosen

    def trained_one(self) -> None:
        """The trainer finished the oldest formed batch (and pushed its weights)."""
        if self.trained >= self.formed:
            raise DeadlineError(f"batch {self.trained} trained before it was formed")
        self.trained += 1

    @property
    def idle(self) -> bool:
        """Nothing admitted and untrained: a checkpoint here resumes exactly."""
        return not self.groups and self.formed == self.trained


# A group's source: group index -> (payload, prompt token ids, row ids [n], limits [n] or None).
Source = Callable[[int], tuple[Any, list[int], np.ndarray, np.ndarray | None]]


class EngineStream:
    """The stream's host loop over the Engine's verbs (prefill_insert, generate):
    admits groups from `source` into free slots, decodes a chunk at a time
    with the newest weights, and hands out batches of B_p complete groups.

    `cond` guards the book: split mode's trainer calls `trained` and `allow` from its
    own thread while the sampler thread runs `step` (the engine's work runs outside it).
    """

    def __init__(self, engine: Engine, book: StreamBook, *, n: int, key, source: Source):
        self.engine, self.book, self.G = engine, book, int(n)
        self.key, self.source = key, source
        self.refill_min = max(1, engine.slots // 64)
        self.cond = threading.Condition(threading.RLock())
        self.state = None  # the engine's EngineState, made at the first step
        self.prompts: dict[int, tuple[Any, list[int], np.ndarray, np.ndarray | None]] = {}
        G = self.G

        def limit(r: int) -> int | None:
            lim = self.prompts[r // G][3]
            return None if lim is None else int(lim[r % G])

        # The slots; rows g * n + s (group g, sample s).
        self.slots = SlotBook(
            engine,
            n=G,
            key=key,
            prompt=lambda g: self.prompts[g][1],
            row_id=lambda r: self.prompts[r // G][2][r % G],
            limit=limit,
        )
        self.rows: dict[int, dict[int, dict]] = {}  # group -> sample -> the row's fields
        # Occupancy: kept tokens / slot-steps run.
        self.kept_tokens = 0

    # ---- the trainer's side (locked) ------------------------------------------------------

    def allow(self, step: int) -> None:
        with self.cond:
            self.book.allow(step)
            self.cond.notify_all()

    def trained(self) -> None:
        """A batch is trained and its weights pushed: more groups may enter."""
        with self.cond:
            self.book.trained_one()
            self.cond.notify_all()

    @property
    def idle(self) -> bool:
        with self.cond:
            return self.book.idle

    @property
    def slot_steps(self) -> int:
        return self.slots.slot_steps

    @property
    def occupancy(self) -> float:
        return self.kept_tokens / max(self.slot_steps, 1)

    def count_afresh(self) -> None:
        """Occupancy from here on (the stream drained: as a resumed run counts it)."""
        self.kept_tokens = self.slots.slot_steps = 0

    # ---- the sampler's side ---------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.slots.busy() or self.slots.queue)

    def has_work(self) -> bool:
        """Rows to decode, or a group that may enter (call under `cond`)."""
        return self.busy() or self.book.can_admit()

    def next_batch(self, weights: Callable[[], Weights]) -> tuple[list, Rollouts]:
        """Decode until a batch can be formed (colocated: the trainer waits). The
        engine's decode layout of the weights goes with it: the trainer's update needs
        the memory, and the next chunk decodes with the next version."""
        while True:
            got = self.take()
            if got is not None:
                self.engine.drop_prepared()
                return got
            if not self.step(weights):
                raise DeadlineError(
                    f"the stream cannot form batch {self.book.formed}: nothing in flight "
                    f"and no group may enter (limit {self.book.limit // self.book.P})"
                )

    def take(self) -> tuple[list, Rollouts] | None:
        """The next batch (payloads, Rollouts with groups renumbered 0..P-1), if formed."""
        with self.cond:
            groups = self.book.take()
        if groups is None:
            return None
        per_group = [self.rows.pop(g) for g in groups]
        rows = [got[s] for got in per_group for s in range(self.G)]
        fields = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        fields["group_ids"] = np.repeat(np.arange(len(groups), dtype=np.int32), self.G)
        payloads = [self.prompts.pop(g)[0] for g in groups]
        return payloads, state_rollouts(fields)

    def step(self, weights: Callable[[], Weights]) -> bool:
        """Admit and insert what fits, decode one chunk, collect the rows that ended.
        False if there was nothing to do."""
        engine = self.engine
        with self.cond:
            # Weights and admissions in one critical section: a group admitted when t
            # batches are trained samples with weights of version >= t x M.
            params, version = weights()
            slots = self.slots
            while len(slots.queue) < slots.free() and self.book.can_admit():
                g = self.book.admit()
                self.prompts[g] = self.source(g)
                slots.add(g * self.G + s for s in range(self.G))
        if self.state is None:
            self.state = engine.init()
        self.state = slots.refill(params, self.state)
        if not slots.busy():
            return False
        # End the chunk early (once refill_min rows ended in it) to refill slots only
        # when there is something to put in them: rows waiting, or a group that may enter.
        with self.cond:
            refill = bool(slots.queue) or self.book.can_admit()
        at = self.refill_min if refill else None
        weights = engine.prepared(params, version)  # once per version
        self.state, out = engine.generate(weights, self.state, version=version, refill_at=at)
        self._collect(out)
        return True

    def _collect(self, out: ChunkOut) -> None:
        """The rows the chunk ended, as fields of their groups; complete groups to the book."""
        Tp = self.engine.prompt_len
        ended = self.slots.collect(out)
        complete = []
        for i, r in enumerate(ended.rows):
            g, s = divmod(int(r), self.G)
            prompt = self.prompts[g][1]
            prompt_tokens = np.full((Tp,), self.engine.pad_id, np.int32)
            prompt_tokens[Tp - len(prompt) :] = prompt
            row = {k: ended.columns[k][i] for k in COLUMNS}
            row.update(
                prompt_tokens=prompt_tokens,
                kv_start=np.int32(Tp - len(prompt)),
                lengths=np.int32(ended.lengths[i]),
                finish=np.int32(ended.finish[i]),
                truncated=bool(ended.truncated[i]),
                row_ids=np.int32(self.prompts[g][2][s]),
            )
            if ended.routes is not None:
                row["routes"] = ended.routes[i]
            self.kept_tokens += int((~row["injected"][: row["lengths"]]).sum())
            self.rows.setdefault(g, {})[s] = row
            if len(self.rows[g]) == self.G:
                complete.append(g)
        if complete:
            with self.cond:
                for g in complete:
                    self.book.complete(g)
                self.cond.notify_all()


def trainer_stream(parts, prompts, first_step: int) -> EngineStream:
    """The trainer's stream on `parts.engine`: group g is prompt g % B_p of the prompts
    drawn for step g // B_p (drawn from `prompts`, a `PromptSource`, when that step's
    first group enters), its rows keyed as that step's rows in every mode
    (`phases.row_ids`)."""
    from rl_jax.train import phases
    from rl_jax.train.accounting import batches_in_flight

    P, G = parts.prompts_per_batch, parts.samples_per_prompt
    drawn: dict[int, tuple[list, list[list[int]]]] = {}  # step -> (problems, prompt ids)

    def source(g: int):
        step, i = divmod(g, P)
        if step not in drawn:
            problems = prompts.draw()
            drawn[step] = (problems, phases.prompt_ids(parts, problems))
        problems, ids = drawn[step]
        rows = phases.row_ids(parts, step, P)[i * G : (i + 1) * G]
        if i == P - 1:
            del drawn[step]
        return problems[i], ids[i], rows, None

    book = StreamBook(P=P, W=batches_in_flight(parts.cfg), first_step=first_step)
    return EngineStream(parts.engine, book, n=G, key=phases.sample_key(parts), source=source)
