"""The host side of an engine's slots, shared by `Engine.run` and the trainer's stream
(`rl_jax.train.stream.EngineStream`): rows wait in a queue, enter free slots (their
group's prompt prefilled once into the prefix pool, for all of the group's rows), and
bring their columns chunk by chunk (`ChunkOut`) until they end.

Rows are numbered r = g * n + s (group g, sample s); the caller says what each group's
prompt is and each row's id (the key of its draws) and limit.

The KV cache is paged (`PageBook`): a row takes the pages of its worst case (its
prompt and its limit) when it enters a slot and gives them back when it ends. A row
enters only when its slot's batch shard has them free; none is ever preempted, so a
row's tokens never depend on how full the cache was.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import jax
import numpy as np

from rl_jax.kernels.xla import pages_needed
from rl_jax.models.moe import route_dtype
from rl_jax.sampling._decoder import round_up, to_host

if TYPE_CHECKING:
    from rl_jax.sampling._engine import ChunkOut, Engine
    from rl_jax.sampling._engine_programs import EngineState

# A row's columns, as `generate` returns them for a chunk: dtype and the value of a
# column the row has not reached (None: the engine's pad id).
COLUMNS = {
    "tokens": (np.int32, None),
    "logprobs": (np.float32, 0.0),
    "versions": (np.int32, -1),
    "injected": (np.bool_, False),
}


class PageBook:
    """The pages of an engine's KV cache, per batch shard: which are free and which slot
    holds which. Slots s_0 .. of shard d (`slots_per_shard` each, in order) take pages
    of that shard, numbered 0 .. pages_per_shard - 1 there (a row's pages live on its
    device). A page is held by one slot at a time (`take` refuses a held one)."""

    def __init__(self, *, shards: int, slots_per_shard: int, pages_per_shard: int):
        self.slots_per_shard, self.pages_per_shard = int(slots_per_shard), int(pages_per_shard)
        self._free = [collections.deque(range(pages_per_shard)) for _ in range(shards)]
        self._owner = np.full((shards, pages_per_shard), -1, np.int64)  # page -> slot
        self.held: dict[int, list[int]] = {}  # slot -> its pages
        self.peak = 0  # most pages held at once

    @property
    def total(self) -> int:
        return self._owner.size

    def in_use(self) -> int:
        return int((self._owner >= 0).sum())

    def shard(self, slot: int) -> int:
        return int(slot) // self.slots_per_shard

    def free(self, slot: int) -> int:
        """Free pages on `slot`'s shard."""
        return len(self._free[self.shard(slot)])

    def take(self, slot: int, n: int) -> list[int]:
        """n free pages of `slot`'s shard for the row entering it."""
        d, slot = self.shard(slot), int(slot)
        if slot in self.held:
            raise RuntimeError(f"slot {slot} takes pages while holding {self.held[slot]}")
        if n > len(self._free[d]):
            raise RuntimeError(f"slot {slot} needs {n} pages; shard {d} has {len(self._free[d])}")
        pages = [self._free[d].popleft() for _ in range(n)]
        if (self._owner[d, pages] >= 0).any():
            raise RuntimeError(f"pages {pages} of shard {d} handed out twice")
        self._owner[d, pages] = slot
        self.held[slot] = pages
        self.peak = max(self.peak, self.in_use())
        return pages

    def give_back(self, slot: int) -> None:
        """The pages of `slot`'s row, which ended, free again."""
        d, pages = self.shard(slot), self.held.pop(int(slot))
        self._owner[d, pages] = -1
        self._free[d].extend(pages)


class Ended(NamedTuple):
    """The rows a chunk ended ([E], in slot order), their columns ([E, gen_len], one
    dict entry per `COLUMNS` name) and end values ([E]); with `Engine.record_routes`,
    each token's experts ([E, prompt_len + gen_len, L, k], as `Rollouts.routes`)."""

    rows: np.ndarray
    columns: dict[str, np.ndarray]
    lengths: np.ndarray
    finish: np.ndarray
    truncated: np.ndarray
    routes: np.ndarray | None = None


class _Routes:
    """The experts an engine records (`Engine.record_routes`), on the host: each prompt's
    from its prefill (taken from the pool as it is prefilled, read when a row of it
    ends, kept until its rows all have) and each slot's decode steps' (from the chunks)."""

    def __init__(self, engine: Engine, G: int):
        spec, S = engine.spec, engine.slots
        self.G, self.Tp = G, engine.prompt_len
        self.cols = np.zeros(
            (S, engine.gen_len, spec.num_layers, spec.num_experts_per_tok),
            route_dtype(spec.num_experts),
        )
        self.prompts: dict[int, tuple[list, int]] = {}  # group -> ([its prefill's], index)
        self.unended: dict[int, int] = {}  # group -> its rows not ended yet

    def prefilled(self, state: EngineState, groups: list[int], into: list[int]) -> None:
        """The new groups' prompts' experts, taken from the pool before a call reuses it."""
        if groups:
            held = [state.pool.routes[np.asarray(into)]]  # dispatched now, read later
            for j, g in enumerate(groups):
                self.prompts[g], self.unended[g] = (held, j), self.G

    def ended(self, rows, slots, starts, lengths) -> np.ndarray:
        """[E, prompt_len + gen_len, L, k] of the rows that ended in `slots`, their prompts
        starting at column `starts` and `lengths` tokens generated: the prompt's tokens
        but the last (its prefill's), then the tokens each decode step fed (the last
        prompt token's first); 0 at padding and at the last token (never fed)."""
        shape = (len(rows), self.Tp + self.cols.shape[1], *self.cols.shape[2:])
        out = np.zeros(shape, self.cols.dtype)
        for i, (r, slot) in enumerate(zip(rows, slots, strict=True)):
            g = int(r) // self.G
            held, j = self.prompts[g]
            if isinstance(held[0], jax.Array):
                held[0] = np.asarray(to_host(held[0]))
            out[i, : self.Tp - 1] = held[0][j, : self.Tp - 1]
            out[i, self.Tp - 1 : -1] = self.cols[slot]
            out[i, : starts[i]] = out[i, self.Tp - 1 + lengths[i] :] = 0
            self.unended[g] -= 1
            if not self.unended[g]:
                del self.unended[g], self.prompts[g]
        return out


class SlotBook:
    """Which row is in which slot, which group's prompt in which prefix pool entry, the
    rows waiting, and each slot's row as the chunks bring its columns.

    prompt(g): group g's prompt token ids; row_id(r): row r's id; limit(r): its max new
    tokens, or None for the engine's `cfg.max_new_tokens` (for every row of a refill, if
    any row's is None).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        n: int,
        key,
        prompt: Callable[[int], Sequence[int]],
        row_id: Callable[[int], int],
        limit: Callable[[int], int | None],
    ):
        self.engine, self.G, self.key = engine, int(n), key
        self.prompt, self.row_id, self.limit = prompt, row_id, limit
        S, Tg = engine.slots, engine.gen_len
        self.slot_row = np.full((S,), -1, np.int64)  # slot -> row, -1 free
        self.queue: collections.deque[int] = collections.deque()  # rows waiting for a slot
        self.pooled: dict[int, int] = {}  # group -> its prompt's pool entry
        self.left: dict[int, int] = {}  # pooled group -> its rows not yet in a slot
        self.free_entries = list(range(engine.pool_size))
        self.pages = PageBook(
            shards=engine.shards,
            slots_per_shard=S // engine.shards,
            pages_per_shard=engine.shard_pages,
        )
        self.cols = {k: np.empty((S, Tg), d) for k, (d, _) in COLUMNS.items()}  # [S, Tg]
        self.routes = _Routes(engine, self.G) if engine.record_routes else None
        self.blank = {k: engine.pad_id if v is None else v for k, (_, v) in COLUMNS.items()}
        self.slot_steps = self.prefills = self.prefilled = 0

    def add(self, rows: Iterable[int]) -> None:
        """Rows to the end of the queue. Every row of a group must be queued before any
        of them takes a slot: a pooled group counts n rows left to enter."""
        self.queue.extend(rows)

    def free(self) -> int:
        return int((self.slot_row < 0).sum())

    def busy(self) -> bool:
        """Whether any slot holds a row."""
        return bool((self.slot_row >= 0).any())

    def need(self, r: int) -> int:
        """Pages row r writes at most: its prompt and its limit (`pages_needed`)."""
        eng = self.engine
        limit = self.limit(r)
        new_tokens = eng.cfg.max_new_tokens if limit is None else int(limit)
        return pages_needed(len(self.prompt(r // self.G)), new_tokens, eng.page_size)

    def _pick(self, free: np.ndarray) -> tuple[list[int], list[int], list[int]]:
        """Rows for the `free` slots, in queue order, their slots, and the groups whose
        prompts they need prefilled (at most a prefill's, of one length bucket, while
        pool entries are free: a prompt's KV depends only on it and its bucket). A row
        whose prompt cannot enter now lets later rows of pooled prompts pass; a row
        whose pages no free slot's shard has stops the pick (it enters first, later),
        as does one whose shard took a call's rows (`Engine.insert_rows`)."""
        eng, book = self.engine, self.pages
        open_slots = [int(s) for s in free]
        spare = {book.shard(s): book.free(s) for s in open_slots}
        quota = {sh: eng.insert_rows // eng.shards for sh in spare}  # a call's rows per shard
        taken, slots, new, bucket = [], [], [], None
        skipped = False
        for at, r in enumerate(self.queue):
            if not open_slots:
                break
            g = r // self.G
            fresh = g not in self.pooled and g not in new
            if fresh:
                b = round_up(len(self.prompt(g)), eng.length_bucket)
                room = len(new) < min(eng.prefill_prompts, len(self.free_entries))
                if not room or (bucket is not None and b != bucket):
                    skipped = True
                    continue
            need = self.need(r)
            fits = (s for s in open_slots if spare[book.shard(s)] >= need and quota[book.shard(s)])
            slot = next(fits, None)
            if slot is None:
                break
            if fresh:
                bucket = b
                new.append(g)
            open_slots.remove(slot)
            spare[book.shard(slot)] -= need
            quota[book.shard(slot)] -= 1
            taken.append(at)
            slots.append(slot)
        if skipped:
            rows = [self.queue[at] for at in taken]
            keep = set(taken)
            self.queue = collections.deque(r for at, r in enumerate(self.queue) if at not in keep)
        else:
            rows = [self.queue.popleft() for _ in taken]
        return rows, slots, new

    def refill(self, params, state: EngineState) -> EngineState:
        """Fill free slots from the queue: one prefill_insert call per set of new prompts
        (one, unless prompts of several buckets or over a prefill's count enter, or more
        rows than a call inserts), with the rows whose prompts are pooled, each with the
        pages it needs."""
        while self.queue:
            free = np.flatnonzero(self.slot_row < 0)
            if not len(free):
                break
            rows, slots, new = self._pick(free)
            if not rows:
                break
            into = [self.free_entries.pop(0) for _ in new]
            self.pooled.update(zip(new, into, strict=True))
            self.left.update({g: self.G for g in new})
            limits = [self.limit(r) for r in rows]
            pages = [self.pages.take(s, self.need(r)) for s, r in zip(slots, rows, strict=True)]
            state = self.engine.prefill_insert(
                params,
                state,
                [self.prompt(g) for g in new],
                into,
                slots,
                [self.pooled[r // self.G] for r in rows],
                [int(self.row_id(r)) for r in rows],
                [r // self.G for r in rows],
                key=self.key,
                pages=pages,
                limits=None if any(x is None for x in limits) else [int(x) for x in limits],
            )
            if self.routes is not None:
                self.routes.prefilled(state, new, into)
                self.routes.cols[slots] = 0
            self.prefills += bool(new)
            self.prefilled += len(new)
            self.slot_row[slots] = rows
            for k, v in self.blank.items():
                self.cols[k][slots] = v
            for r in rows:  # a group whose rows all entered frees its pool entry
                g = r // self.G
                self.left[g] -= 1
                if self.left[g] == 0:
                    del self.left[g]
                    self.free_entries.append(self.pooled.pop(g))
        return state

    def held(self) -> np.ndarray:
        """The row in each slot now ([S], -1 free): what a chunk dispatched now decodes
        (`collect`'s `rows`)."""
        return self.slot_row.copy()

    def _routes(self, rows, slots, lengths) -> np.ndarray:
        starts = [self.engine.prompt_len - len(self.prompt(int(r) // self.G)) for r in rows]
        return self.routes.ended(rows, slots, starts, lengths)

    def collect(self, out: ChunkOut, rows: np.ndarray | None = None) -> Ended:
        """The chunk's columns into each slot's row; the rows that ended leave their
        slots and come back. `rows`: the slots' rows when the chunk was dispatched
        (`held`; default: now): a host that dispatches a chunk before reading the one
        before it skips the rows that one ended (their slots may hold new rows)."""
        self.slot_steps += self.engine.slots * out.steps
        at = self.slot_row if rows is None else rows
        held = np.flatnonzero((at >= 0) & (at == self.slot_row))
        cols = out.start[held, None] + np.arange(out.tokens.shape[1])[None, :]
        ok = cols < self.engine.gen_len
        s_idx, c_idx = np.broadcast_to(held[:, None], cols.shape)[ok], cols[ok]
        for k in COLUMNS:
            self.cols[k][s_idx, c_idx] = getattr(out, k)[held][ok]
        if self.routes is not None:
            self.routes.cols[s_idx, c_idx] = out.routes[held][ok]
        ended = held[out.done[held]]
        rows = self.slot_row[ended].copy()
        got = Ended(
            rows=rows,
            columns={k: self.cols[k][ended] for k in COLUMNS},
            lengths=out.lengths[ended],
            finish=out.finish[ended],
            truncated=out.truncated[ended],
            routes=None if self.routes is None else self._routes(rows, ended, out.lengths[ended]),
        )
        self.slot_row[ended] = -1
        for slot in ended:
            self.pages.give_back(int(slot))
        return got
