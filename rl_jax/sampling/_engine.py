"""The continuous-batching engine: S decode slots refilled as their rows end.

    engine = Engine(spec, cfg, slots=S, eos_id=eos, pad_id=pad)
    rollouts, stats = engine.run(params, prompt_ids, n=G, seed=0)    # the host loop

or the verbs the host loop is made of (JetStream's prefill, insert, generate):

    state = engine.init()                                   # S empty slots
    state = engine.prefill_insert(params, state, prompts, into, slots, sources,
                                  row_ids, group_ids, key=key)  # prefill + insert
    state, out = engine.generate(params, state, version=v)  # `chunk` steps of every slot
    ended = engine.finished(out)                            # slots whose rows ended

A batch decoded in step runs until its longest row ends, so a row that ends early
leaves its slot idle (compute used ~ mean length / max length of the batch). Here a
slot whose row ended takes the next row of the queue between chunks: with
long-tailed lengths the slots stay busy (benchmarks/sampler.py --lengths longtail).

Three compiled programs: `prefill_insert` prefills up to
`prefill_prompts` new prompts into a pool of prefixes (each prompt once, for all of
its rows, in blocks of `prefill_block` prompts; blocks without a new prompt, and the
whole prefill when a refill needs no new prompt, are skipped) and copies pool entries into
the pages of the rows entering free slots (a scatter of their pages only); `prepare`
lays a version's weights out for the decode step (`DecodeWeights`: stacked, fused,
packed for the platform's kernels), once per version in a host loop (`prepared`);
`generate` decodes every slot for a chunk of steps on them. Its result carries,
besides the state, the chunk's new columns of every slot and the slots' end flags:
the host reads that one small output per chunk (`ChunkOut`) and assembles the rows
itself, so collecting ended rows costs no program and no transfer of whole rows.
`init` is a fill of empty buffers (no model code).

The KV cache is paged (`rl_jax.kernels.xla.PagedKV`): N pages of `page_size`
positions, which rows own through their page tables (`SamplerState.pages`). A row's
position p (its prompt's first token is position 0) is at page table[p // page_size];
a decode step writes each row's key and value at its position and attends only to
the pages its row has filled (the platform's paged attention: a C++ kernel on CPU,
the Pallas paged attention kernel on TPU, XLA's reference elsewhere), where a
contiguous cache is read whole or up to the furthest row. The host hands out pages
(`SlotBook`, `PageBook`): a row takes its worst case's pages (its prompt and its
limit) when it enters a slot, on its slot's batch shard, and gives them back when it
ends; it enters only when they are free, and no row is preempted. A group's prompt
is prefilled once into the pool and copied into each of its rows' own pages when the
row enters: every row's pages are its own and live on its device, so nothing is
shared across devices or outlives a row, and a step reads the same bytes as with
shared pages (each row reads its prompt's pages every step either way).

A row's tokens sit at the same columns whatever its slot: its prompt left-padded to
`prompt_len` (the longest prompt's bucket), completion token t fed at slot
prompt_len + t, i.e. at its position prompt length + t (`decode_step` at each row's
own position). A row's draws come from its key and its own step (`row_step_uniforms`), and no
op mixes rows, so its tokens and log-probs depend only on its key, its prompt and
the weights of each chunk: not on its slot, its pages, its neighbours or the slot
count (tests/test_engine.py). Weights are an argument of `generate`: rows in flight keep
the KV cache earlier weights wrote (PipelineRL's in-flight update), and every
token records the version that sampled it.

Compiles: `generate` once per chunk size; `prepare` once; `prefill_insert` once per
prompt length bucket (the host loop prefills each prompt in its own bucket). With
`fixed_shapes` (the trainer's engines) every prompt is prefilled at `prompt_len`: one
program, whatever the prompts' lengths.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from rl_jax.config.sampling import SamplingConfig
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import Transformer
from rl_jax.sampling._decoder import Params, pack_prompts, round_up, state_rollouts, to_host
from rl_jax.sampling._engine_programs import DecodeWeights, EnginePrograms, EngineState
from rl_jax.sampling._rollouts import Rollouts
from rl_jax.sampling._slots import COLUMNS, SlotBook
from rl_jax.sharding.rules import num_batch_shards


@dataclasses.dataclass(frozen=True)
class ChunkOut:
    """What a `generate` call tells the host (numpy): the steps it ran, and for every
    slot its step at the chunk's start, the chunk's columns start .. start + chunk - 1
    ([S, chunk]; columns past the row's end are padding, past gen_len repeat the
    last), and its end flags after the chunk ([S]); with `record_routes`, the experts of
    the tokens each step fed ([S, chunk, L, k]: column j of a row is its column
    start + j's, the last prompt token's at column 0)."""

    steps: int
    start: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    injected: np.ndarray
    done: np.ndarray
    lengths: np.ndarray
    finish: np.ndarray
    truncated: np.ndarray
    routes: np.ndarray | None = None


class PendingChunk(NamedTuple):
    """A chunk `Engine.dispatch` queued: its outputs on the device, not read yet."""

    rows: dict
    steps: jax.Array


@dataclasses.dataclass(frozen=True)
class RunStats:
    """What a run of the host loop did (`Engine.run`)."""

    chunks: int  # generate calls
    slot_steps: int  # slots x decode steps run
    kept_tokens: int  # policy tokens of the rollouts (completion_mask)
    decoded_tokens: int  # tokens written, injected ones included
    prefills: int  # prefill_insert calls that prefilled prompts
    prompts_prefilled: int  # prompts prefilled (each once)
    pages: int = 0  # pages of the KV cache
    pages_peak: int = 0  # most pages rows held at once
    pages_held: int = 0  # pages rows held when the run ended (none: every row gave its back)
    # The fraction of the run's time the device had no program to run (`timeline=True`):
    # the gaps between one program's end and the next one's dispatch.
    device_idle: float | None = None

    @property
    def occupancy(self) -> float:
        """The fraction of slot-steps that produced a kept token."""
        return self.kept_tokens / max(self.slot_steps, 1)


class Engine(EnginePrograms):
    """Continuous-batching sampling; see the module docstring. Here: the verbs and the
    host loop; the geometry, the state and the compiled programs are `EnginePrograms`'s
    (`_engine_programs.py`). The arguments (and `Decoder`'s: mesh, eos_id, pad_id,
    interrupt_ids, rules):

    slots: S, the decode slots (a multiple of the mesh's batch shards).
    chunk: decode steps per `generate` call (default `cfg.decode_chunk`, else 16).
    prefill_prompts: prompts per prefill (fewer are padded); also the prefixes held
    at once.
    prefill_block: prompts prefilled together (default: all `prefill_prompts`): a
    prefill runs in fixed blocks of this many, skipping blocks with no new prompt, so
    a refill of a few prompts computes their blocks only, and a prompt's KV depends on
    the block size, never on how many prompts were prefilled with it (XLA:CPU's
    prefill matmuls round differently for different row counts; measured in
    tests/test_engine.py).
    prompt_len: the longest prompt (default `cfg.max_prompt_len`), rounded up to
    `cfg.length_bucket`. Generations are up to `cfg.max_new_tokens` (per-row limits
    may be lower).
    fixed_shapes: prefill every prompt at `prompt_len`: one prefill_insert program
    instead of one per length bucket (more padding computed in exchange).
    page_size: positions per page of the KV cache (default: the platform's,
    `Decode.page_size`).
    kv_pages: pages in the cache, all batch shards together (a multiple of their
    count); default a full table for every slot, so that a free slot can always take
    a row. Fewer make rows wait for pages (`SlotBook`); each shard must hold one
    longest row's.
    insert_rows: rows one prefill_insert call puts into slots, in whole batch shards
    (each shard takes its share): its gathers and scatters run over these, not over
    every slot; more rows take more calls. Default: a sixteenth of the slots (a
    refill's rows), at least one per shard; `for_batch`: every slot.
    kv_quant: "int8" keeps keys and values in int8, a float32 scale per position and
    kv head (`xla.PagedKV`; XLA's paged reference reads it, on every platform); None
    (default) keeps them in the compute dtype. Its log-prob drift:
    docs/results/performance.md.
    record_routes: a mixture of experts records the experts each token was routed to,
    in prefill and decode, into `Rollouts.routes` (routing replay: the trainer routes
    the same tokens to the same experts; `model.routing_replay`).
    """

    # The host's state between calls.
    _last_bucket: int | None = None  # the last prefill's bucket (None yet: prompt_len)
    _clock: _Timeline | None = None  # a run's timeline (`run(timeline=True)`)
    _prepared: tuple | None = None  # (params, version, DecodeWeights): `prepared`

    @classmethod
    def for_batch(
        cls,
        model: ModelSpec | Transformer,
        cfg: SamplingConfig,
        *,
        prompts: int,
        prompt_len: int,
        n: int | None = None,
        mesh=None,
        **kw,
    ) -> Engine:
        """An engine for one batch of `prompts` prompts of up to `prompt_len` tokens: a
        slot for each of their n rows a prompt (default `cfg.n`; in whole batch shards),
        every prompt in one prefill, decoded to the end in one `generate` call
        (`cfg.decode_chunk` if set). `kw`: the other `Engine` arguments (eos_id, pad_id,
        interrupt_ids, rules, page_size, ...)."""
        shards = 1 if mesh is None else num_batch_shards(mesh)
        return cls(
            model,
            cfg,
            slots=round_up(max(1, prompts * (n or cfg.n)), shards),
            chunk=cfg.decode_chunk or cfg.max_new_tokens,
            prompt_len=prompt_len,
            prefill_prompts=max(1, prompts),
            fixed_shapes=True,
            insert_rows=round_up(max(1, prompts * (n or cfg.n)), shards),
            mesh=mesh,
            **kw,
        )

    # ---- the verbs ------------------------------------------------------------------------

    def prefill_insert(
        self,
        params: Params | Transformer,
        state: EngineState,
        prompts: Sequence[Sequence[int]],
        into: Sequence[int],
        slots: Sequence[int],
        sources: Sequence[int],
        row_ids: Sequence[int],
        group_ids: Sequence[int],
        *,
        key: jax.Array,
        pages: Sequence[Sequence[int]],
        limits: Sequence[int] | None = None,
    ) -> EngineState:
        """Prefill up to `prefill_prompts` prompts (each computed once, for all of its
        rows; none: no prefill) into pool entries `into` (of `pool_size`), in the length
        bucket of the longest; then rows into free slots: row j samples the prompt of
        pool entry sources[j] in slot slots[j], its draws keyed by fold_in(key,
        row_ids[j]); limits[j] its max new tokens (default cfg.max_new_tokens); pages[j]
        the pages of the cache it writes (ids on its slot's batch shard, 0 ..
        shard_pages - 1; at least `pages_needed` of its prompt and limit, which the
        caller keeps from every other live row: `SlotBook` does). A prompt's KV
        depends only on it and on its bucket. `state` is donated."""
        lim = self._check_insert(prompts, into, slots, sources, row_ids, group_ids, pages, limits)
        rows = self._row_arrays(slots, sources, row_ids, group_ids, lim, pages)
        prefill = self._prompt_arrays(prompts, into)  # sets the bucket
        if self._clock:
            self._clock.dispatched()
        return self._prefill_insert(
            self._as_params(params),
            state,
            *self._put_rows(*prefill),
            np.bool_(bool(prompts)),
            *self._put_rows(*rows),
            key,
            # (without prompts, the last prefill's program: its prefill is skipped)
            bucket=self._last_bucket or self.prompt_len,
        )

    def _prompt_arrays(self, prompts, into) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prefill's host arrays: prompts [P, prompt_len] left-padded in the bucket of
        the longest, their lengths [P] and pool entries [P] (past the pool: padding)."""
        P, Q = self.prefill_prompts, self.pool_size
        prompt_pt = np.full((P, self.prompt_len), self.pad_id, np.int32)
        lens_p = np.ones((P,), np.int32)
        into_p = np.full((P,), Q, np.int32)  # padding prompts go past the pool: dropped
        if prompts:
            self._check_prompts(prompts)
            packed, lens = pack_prompts(
                prompts, rows=P, bucket=self.length_bucket, max_len=0, pad_id=self.pad_id
            )
            self._last_bucket = packed.shape[1]
            prompt_pt[:, self.prompt_len - packed.shape[1] :] = packed
            lens_p[:] = lens
            into_p[: len(into)] = into
        return prompt_pt, lens_p, into_p

    def prepare(self, params: Params | Transformer | DecodeWeights) -> DecodeWeights:
        """`params` in the decode step's layout: a pass over the weights (read and
        written) that `generate` makes itself when given params, at every call. A host
        loop prepares each version of its weights once and passes the `DecodeWeights`
        to each of that version's chunks; they hold a second copy of the weights in the
        compute dtype while it keeps them."""
        if isinstance(params, DecodeWeights):
            return params
        return self._prepare(self._as_params(params))

    def prepared(self, params: Params | Transformer, version: int) -> DecodeWeights:
        """`prepare` of `params` once per weights version: the engine keeps the last
        version's `DecodeWeights` (and a reference to `params`) until the version or
        the params object changes (the old layout dropped before the new one is made),
        or `drop_prepared`."""
        held = self._prepared
        if held is None or held[0] is not params or held[1] != version:
            self._prepared = None
            self._prepared = (params, int(version), self.prepare(params))
        return self._prepared[2]

    def drop_prepared(self) -> None:
        """Forget the kept `DecodeWeights` (their memory goes with the last reference)."""
        self._prepared = None

    def generate(
        self,
        params: Params | Transformer | DecodeWeights,
        state: EngineState,
        *,
        version: int = 0,
        refill_at: int | None = None,
    ) -> tuple[EngineState, ChunkOut]:
        """`chunk` decode steps of every slot, fewer if every slot ends first, or once
        `refill_at` rows have ended in it (time to refill their slots); tokens sampled
        here carry `version`. `params`: the weights, or the `DecodeWeights` `prepare`
        made of them (else it makes them for this call). Returns the state (`state` is
        donated) and the chunk's `ChunkOut` (one small device-to-host read): `dispatch`,
        then `read`."""
        state, pending = self.dispatch(params, state, version=version, refill_at=refill_at)
        return state, self.read(pending)

    def dispatch(
        self,
        params: Params | Transformer | DecodeWeights,
        state: EngineState,
        *,
        version: int = 0,
        refill_at: int | None = None,
    ) -> tuple[EngineState, PendingChunk]:
        """`generate`'s chunk, dispatched and not waited for (JAX dispatches
        asynchronously): the host may queue the next program and do its own work while
        the device decodes, then `read` the chunk."""
        at = self.slots + 1 if refill_at is None else int(refill_at)
        if self._clock:
            self._clock.dispatched()
        weights = self.prepare(params)
        state, rows, steps = self._generate(
            weights, state, np.int32(version), np.int32(at), steps=self.chunk
        )
        return state, PendingChunk(rows, steps)

    @staticmethod
    def read(pending: PendingChunk) -> ChunkOut:
        """A dispatched chunk's `ChunkOut` (waits for it)."""
        rows, steps = to_host((pending.rows, pending.steps))
        return ChunkOut(steps=int(steps), **rows)

    @staticmethod
    def finished(out: ChunkOut) -> np.ndarray:
        """The slots whose rows have ended (done slots that were free stay done: the
        host knows which slots hold rows)."""
        return np.flatnonzero(out.done)

    # ---- the host loop --------------------------------------------------------------------

    def run(
        self,
        params: Params | Transformer,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int | None = None,
        key: jax.Array | None = None,
        seed: int = 0,
        version: int = 0,
        max_new_tokens: Sequence[int] | int | None = None,
        order: Sequence[int] | None = None,
        weights: Callable[[int], tuple[Params, int]] | None = None,
        refill_min: int | None = None,
        row_ids: Sequence[int] | None = None,
        overlap: bool = True,
        timeline: bool = False,
    ) -> tuple[Rollouts, RunStats]:
        """Sample n rollouts of each prompt: R = P * n rows, row r = p * n + s of prompt
        p, its draws keyed by fold_in(key, row_ids[r]) (default r). Rows enter free
        slots in `order` (a permutation of range(R), default in order; a row whose prompt
        waits for room in the prefix pool lets later rows of pooled prompts pass); each
        prompt is prefilled once, when its first row enters. `weights(chunk)` ->
        (params, version) gives the weights of each chunk (default: `params`, `version`
        throughout). `max_new_tokens`: one limit for all rows or one per row. A chunk
        ends early once `refill_min` rows have ended in it while rows wait (default
        S / 64).

        `overlap`: dispatch chunk k + 1 before reading chunk k, so that the device
        decodes while the host reads a chunk, assembles its rows and refills the slots
        (the refill then comes a chunk later: a slot whose row ended in chunk k is
        refilled after chunk k + 1). `timeline`: measure the device's idle time between
        programs (`RunStats.device_idle`; a thread waits on each chunk's outputs).
        Returns the rollouts in row order and the run's `RunStats`."""
        G = self.cfg.n if n is None else int(n)
        P = len(prompt_ids)
        if P == 0 or G < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {P} prompts, n={G}")
        R = P * G
        limits = np.broadcast_to(
            np.asarray(self.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens), (R,)
        )
        self._check_prompts(prompt_ids)
        queue = list(range(R)) if order is None else [int(r) for r in order]
        if sorted(queue) != list(range(R)):
            raise ValueError(f"order must be a permutation of range({R})")
        key = jax.random.key(seed) if key is None else key
        ids = np.arange(R) if row_ids is None else np.asarray(row_ids, np.int64)
        if ids.shape != (R,):
            raise ValueError(f"row_ids needs {R} ids (prompts x n), got shape {ids.shape}")
        loop = _HostLoop(self, prompt_ids, G, key, limits, queue, ids)
        refill_min = max(1, self.slots // 64) if refill_min is None else int(refill_min)
        if weights is None:
            weights = lambda chunk: (params, version)  # noqa: E731
        clock = _Timeline() if timeline else None
        chunks = self._drive(loop, weights, refill_min, overlap=overlap, clock=clock)
        return loop.rollouts(), loop.stats(chunks, clock.idle() if clock else None)

    def _drive(self, loop: _HostLoop, weights, refill_min: int, *, overlap: bool, clock) -> int:
        """`run`'s host loop: refill, dispatch a chunk, read the one before it (or this
        one, without `overlap`); the chunks run."""
        state = self.init()
        self._clock = clock
        chunk, pending = 0, None
        try:
            while loop.slots.queue or loop.slots.busy() or pending is not None:
                params, version = weights(chunk)  # this chunk's weights prefill its new rows
                state = loop.slots.refill(params, state)
                queued = None
                if loop.slots.busy():
                    at = refill_min if loop.slots.queue else None
                    prepared = self.prepared(params, version)
                    state, out = self.dispatch(prepared, state, version=version, refill_at=at)
                    queued = (out, loop.slots.held())
                    chunk += 1
                    if clock:
                        clock.watch(out.steps)
                if pending is not None:
                    loop.collect(self.read(pending[0]), pending[1])
                pending = queued
                if not overlap and pending is not None:
                    loop.collect(self.read(pending[0]), pending[1])
                    pending = None
        finally:
            self._clock = None
            self.drop_prepared()  # the run's weights are the caller's again
        return chunk


class _HostLoop:
    """The host side of `Engine.run`: its slots (`SlotBook`, rows r = p * n + s of
    prompt p) and every row's columns once it has ended."""

    def __init__(self, engine: Engine, prompt_ids, G: int, key, limits, queue, row_ids):
        self.engine, self.prompts, self.G, self.row_ids = engine, prompt_ids, G, row_ids
        self.slots = SlotBook(
            engine,
            n=G,
            key=key,
            prompt=prompt_ids.__getitem__,
            row_id=row_ids.__getitem__,
            limit=lambda r: int(limits[r]),
        )
        self.slots.add(queue)
        R, Tg = len(queue), engine.gen_len
        blank = self.slots.blank
        self.cols = {k: np.full((R, Tg), blank[k], dtype) for k, (dtype, _) in COLUMNS.items()}
        self.ends = {k: np.zeros((R,), np.int32) for k in ("lengths", "finish", "truncated")}
        self.routes: np.ndarray | None = None  # [R, Tp + Tg, L, k] (record_routes)

    def collect(self, out: ChunkOut, rows: np.ndarray) -> None:
        """The rows the chunk ended into their buffers (`rows`: the slots' rows when
        it was dispatched)."""
        ended = self.slots.collect(out, rows)
        for k, v in ended.columns.items():
            self.cols[k][ended.rows] = v
        for k in self.ends:
            self.ends[k][ended.rows] = getattr(ended, k)
        if ended.routes is not None:
            if self.routes is None:
                R = len(self.row_ids)
                self.routes = np.zeros((R, *ended.routes.shape[1:]), ended.routes.dtype)
            self.routes[ended.rows] = ended.routes

    def rollouts(self) -> Rollouts:
        eng = self.engine
        R, Tp = len(self.row_ids), eng.prompt_len
        rows = [self.prompts[r // self.G] for r in range(R)]
        prompt_tokens, lens = pack_prompts(rows, rows=R, bucket=Tp, max_len=0, pad_id=eng.pad_id)
        return state_rollouts(
            {
                "prompt_tokens": prompt_tokens,
                "kv_start": Tp - lens,
                **self.cols,
                "lengths": self.ends["lengths"],
                "finish": self.ends["finish"],
                "truncated": self.ends["truncated"].astype(bool),
                "group_ids": np.arange(R, dtype=np.int32) // self.G,
                "row_ids": self.row_ids.astype(np.int32),
                **({} if self.routes is None else {"routes": self.routes}),
            }
        )

    def stats(self, chunks: int, device_idle: float | None = None) -> RunStats:
        within = np.arange(self.engine.gen_len)[None, :] < self.ends["lengths"][:, None]
        return RunStats(
            chunks=chunks,
            slot_steps=self.slots.slot_steps,
            kept_tokens=int((within & ~self.cols["injected"]).sum()),
            decoded_tokens=int(self.ends["lengths"].sum()),
            prefills=self.slots.prefills,
            prompts_prefilled=self.slots.prefilled,
            pages=self.slots.pages.total,
            pages_peak=self.slots.pages.peak,
            pages_held=self.slots.pages.in_use(),
            device_idle=device_idle,
        )


class _Timeline:
    """When the host dispatched each program of a run and when each chunk's outputs were
    ready (a thread waits on them in order, the GIL released): the device's idle time
    is the gaps between a chunk's end and the next dispatch after it. A prefill_insert
    is dispatched just before its chunk, so its time counts as busy."""

    def __init__(self):
        self._sent: list[float] = []  # dispatch times, every program's
        self._ready: list[float] = []  # each chunk's end
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def dispatched(self) -> None:
        self._sent.append(time.perf_counter())

    def watch(self, output: jax.Array) -> None:
        self._queue.put(output)

    def _wait(self) -> None:
        while (x := self._queue.get()) is not None:
            jax.block_until_ready(x)
            self._ready.append(time.perf_counter())

    def idle(self) -> float:
        """The idle fraction of the run, from the first dispatch to the last chunk's end."""
        self._queue.put(None)
        self._thread.join()
        sent = np.asarray(self._sent)
        idle = 0.0
        for end in self._ready[:-1]:
            after = sent[sent > end]  # the device waits for the host's next dispatch
            idle += float(after[0] - end) if after.size else 0.0
        span = self._ready[-1] - self._sent[0] if self._ready else 0.0
        return idle / span if span > 0 else 0.0
