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
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from rl_jax.config.sampling import SamplingConfig
from rl_jax.kernels import loops
from rl_jax.kernels.xla import Decode, PagedKV, pages_needed
from rl_jax.knobs import ConfigError
from rl_jax.models.decode import decode_weights
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import KVCache, Transformer, dtype_of
from rl_jax.runtime import xla_options
from rl_jax.sampling._decoder import (
    Decoder,
    Params,
    pack_prompts,
    round_up,
    state_rollouts,
    to_host,
)
from rl_jax.sampling._dist import interrupt_lengths, row_keys, row_step_uniforms
from rl_jax.sampling._rollouts import FinishReason, Rollouts
from rl_jax.sampling._slots import COLUMNS, SlotBook
from rl_jax.sampling._state import THINK, SamplerState
from rl_jax.sharding.rules import (
    Rules,
    batch_sharding,
    fit_spec,
    logical_to_spec,
    num_batch_shards,
)

_NO_INTERRUPT = np.iinfo(np.int32).max
KV_QUANT = (None, "int8")  # the engine's KV cache: the compute dtype, or int8 with scales
# The columns of the chunk `generate` returns, and the per-slot values.
_COLUMNS = tuple(COLUMNS)
_SLOT_VALUES = ("done", "lengths", "finish", "truncated")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Prefilled prompts: the pool rows are inserted from (`Engine.prefill_insert`)."""

    cache: KVCache  # k, v [L, Q, K, W, hd]: the prompt's keys at slots < prompt_len - 1
    prompt_tokens: jax.Array  # [Q, prompt_len] int32, left-padded
    kv_start: jax.Array  # [Q] int32 = prompt_len - prompt length

    @property
    def num_prompts(self) -> int:
        return int(self.kv_start.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngineState:
    """The S decode slots and the pool of prefilled prompts; donated to every call.
    (`slots.keys` holds the keys' data, [S, 2] uint32: typed keys coming out of a call
    on a mesh make JAX's dispatch cache take a second entry.)"""

    slots: SamplerState
    pool: Prefix


@dataclasses.dataclass(frozen=True)
class ChunkOut:
    """What a `generate` call tells the host (numpy): the steps it ran, and for every
    slot its step at the chunk's start, the chunk's columns start .. start + chunk - 1
    ([S, chunk]; columns past the row's end are padding, past gen_len repeat the
    last), and its end flags after the chunk ([S])."""

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


class DecodeWeights(NamedTuple):
    """Weights in the decode step's layout (`Engine.prepare`): stacked over layers, the
    projections fused, laid out by the platform's kernels. `generate` takes them as
    they are; made from params, they cost a pass over the weights."""

    tree: dict


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


class Engine(Decoder):
    """Continuous-batching sampling; see the module docstring.

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
    """

    def __init__(
        self,
        model: ModelSpec | Transformer,
        cfg: SamplingConfig,
        *,
        slots: int,
        chunk: int | None = None,
        prompt_len: int | None = None,
        prefill_prompts: int = 4,
        prefill_block: int | None = None,
        fixed_shapes: bool = False,
        page_size: int | None = None,
        kv_pages: int | None = None,
        insert_rows: int | None = None,
        kv_quant: str | None = None,
        mesh=None,
        eos_id: int | Sequence[int] | None = None,
        pad_id: int = 0,
        interrupt_ids: Sequence[int] | None = None,
        rules: str | Rules = "fsdp_tp",
    ):
        super().__init__(
            model,
            cfg,
            mesh=mesh,
            eos_id=eos_id,
            pad_id=pad_id,
            interrupt_ids=interrupt_ids,
            rules=rules,
        )
        if slots < 1 or slots % self.shards:
            raise ConfigError(
                f"engine slots={slots}: need a positive multiple of the mesh's "
                f"{self.shards} batch shards"
            )
        longest = cfg.max_prompt_len if prompt_len is None else int(prompt_len)
        if longest < 1:
            raise ConfigError(
                "the engine needs the longest prompt: set sampling.max_prompt_len "
                "(or pass prompt_len=)"
            )
        self.slots = int(slots)
        self.chunk = int(chunk or cfg.decode_chunk or 16)
        self.prefill_prompts = round_up(int(prefill_prompts), self.shards)
        block = round_up(int(prefill_block or self.prefill_prompts), self.shards)
        self.prefill_block = min(block, self.prefill_prompts)
        rows = int(insert_rows or -(-self.slots // 16))
        if rows < 1:
            raise ConfigError(f"engine insert_rows={insert_rows}: need at least 1")
        self.insert_rows = min(round_up(rows, self.shards), self.slots)
        # A pool of one prefill: a new prompt enters once an earlier one's rows all
        # have (rows of pooled prompts can always enter, so the queue always moves).
        self.pool_size = self.prefill_prompts
        self.fixed_shapes = bool(fixed_shapes)
        self.prompt_len = round_up(longest, cfg.length_bucket)
        self.gen_len = round_up(cfg.max_new_tokens, cfg.length_bucket)
        if longest + cfg.max_new_tokens > self.spec.max_position:
            raise ConfigError(
                f"prompt_len ({longest}) + sampling.max_new_tokens ({cfg.max_new_tokens}) "
                f"exceeds the model's max_position={self.spec.max_position}"
            )
        self._last_bucket = self.prompt_len
        self._clock: _Timeline | None = None  # a run's timeline (`run(timeline=True)`)
        self._prepared: tuple | None = None  # (params, version, DecodeWeights): `prepared`
        if kv_quant not in KV_QUANT:
            raise ConfigError(
                f"engine kv_quant={kv_quant!r}: one of {', '.join(map(str, KV_QUANT))}"
            )
        self.kv_quant = kv_quant
        self._set_pages(page_size, kv_pages)
        opts = xla_options(mesh)
        # With a mesh, every call takes and returns the state in one layout (the one
        # the programs' constraints give), so `init`'s state and every call's result
        # feed the same executables.
        state_sh = self._state_shardings()
        pin = {} if state_sh is None else {"out_shardings": state_sh}
        # (Without a mesh, on the default device: committed there, as the calls'
        # results are, else the first call would compile a program of its own.)
        self._init = _fill_program(
            self._empty_geometry(),
            SingleDeviceSharding(jax.devices()[0]) if state_sh is None else state_sh,
            tuple(sorted(opts.items())),
        )
        self._prefill_insert = jax.jit(
            self._prefill_insert_impl,
            static_argnames=("bucket",),
            donate_argnames=("state",),
            compiler_options=opts,
            **pin,
        )
        if state_sh is not None:
            rows = {k: batch_sharding(mesh, 2 if k in _COLUMNS else 1) for k in _COLUMNS}
            rows.update({k: batch_sharding(mesh, 1) for k in ("start", *_SLOT_VALUES)})
            pin = {"out_shardings": (state_sh, rows, NamedSharding(mesh, PartitionSpec()))}
        self._prepare = jax.jit(self._prepare_impl, compiler_options=opts)
        self._generate = jax.jit(
            self._generate_impl,
            static_argnames=("steps",),
            donate_argnames=("state",),
            compiler_options=opts,
            **pin,
        )

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

    def _set_pages(self, page_size: int | None, kv_pages: int | None) -> None:
        """The paged cache's geometry: page size, pages per row's table (R, a longest
        row's), pages per batch shard."""
        ops = self.decode_ops
        self.page_size = int(page_size or ops.page_size)
        if self.page_size < 1 or self.page_size % ops.page_multiple:
            raise ConfigError(
                f"engine page_size={self.page_size}: need a positive multiple of "
                f"{ops.page_multiple} on this platform's decode ops"
            )
        self.row_pages = pages_needed(self.prompt_len, self.gen_len, self.page_size)
        total = self.slots * self.row_pages if kv_pages is None else int(kv_pages)
        if total % self.shards or total // self.shards < self.row_pages:
            raise ConfigError(
                f"engine kv_pages={total}: need a multiple of the {self.shards} batch "
                f"shards with at least a longest row's {self.row_pages} pages "
                f"(prompt_len {self.prompt_len} + {self.gen_len} new tokens, pages of "
                f"{self.page_size}) on each"
            )
        self.kv_pages = total
        self.shard_pages = total // self.shards
        # The pool of prefilled prompts holds whole pages of a prompt.
        self.prefix_slots = round_up(self.prompt_len, self.page_size)

    def abstract_state(self) -> EngineState:
        """The state's shapes and dtypes, with the layouts the programs give it on the
        mesh (none without one): what `init` would allocate."""
        shapes = jax.eval_shape(self._init_impl)
        shardings = self._state_shardings()
        if shardings is None:
            return shapes
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings
        )

    def programs(self, params) -> dict[str, tuple[Callable, tuple, dict]]:
        """{name: (jitted program, abstract arguments, static arguments)} of
        `prefill_insert` (a whole prefill of `prefill_prompts` prompts at `prompt_len`,
        and `insert_rows` rows into slots) and `generate` (a chunk, on the
        `DecodeWeights` of `params`), for `params` (abstract arrays) and laid out as the
        verbs lay out theirs: `rl_jax.plan` compiles them ahead of time for hardware this
        host does not have."""
        P, Tp = self.prefill_prompts, self.prompt_len

        def arr(shape, dtype=jnp.int32):  # rows over the batch axes; scalars replicated
            sh = None if self.mesh is None else NamedSharding(self.mesh, self._row_spec(len(shape)))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

        key = jax.eval_shape(jax.random.key, 0)
        state = self.abstract_state()
        # slot, source, row id, group id, limit and page table of each insert entry
        I = self.insert_rows
        rows = (*(arr((I,)) for _ in range(5)), arr((I, self.row_pages)))
        prefill = (arr((P, Tp)), arr((P,)), arr((P,)), arr((), jnp.bool_))
        return {
            "prefill_insert": (
                self._prefill_insert,
                (params, state, *prefill, *rows, arr(key.shape, key.dtype)),
                {"bucket": Tp},
            ),
            "generate": (
                self._generate,
                (self.abstract_decode_weights(params), state, arr(()), arr(())),
                {"steps": self.chunk},
            ),
        }

    def abstract_decode_weights(self, params) -> DecodeWeights:
        """The `DecodeWeights` `prepare` makes of abstract `params`, with the layout it
        gives them (its compiled program's: the layout propagates from the params')."""
        shapes = jax.eval_shape(self._prepare, params)
        if self.mesh is None:
            return shapes
        out = self._prepare.lower(params).compile().output_shardings
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, out
        )

    def compile_counts(self) -> dict[str, int]:
        """Executables compiled so far per program (a test of bounded compiles)."""
        fns = {
            "prefill_insert": self._prefill_insert,
            "generate": self._generate,
            "prepare": self._prepare,
        }
        return {name: fn._cache_size() for name, fn in fns.items()}

    @property
    def positions(self) -> int:
        """Positions a row may reach (its rotary table's rows)."""
        return self.prompt_len + self.gen_len

    def _state_shardings(self) -> EngineState | None:
        """Each state array's layout on the mesh (None without one): rows over the batch
        axes, caches by their logical axes, as the programs constrain them."""
        if self.mesh is None:
            return None
        mesh, rules = self.mesh, self.rules
        shape = jax.eval_shape(self._init_impl)

        def logical(axes, x):
            return NamedSharding(mesh, fit_spec(logical_to_spec(axes, rules), x.shape, mesh))

        slots = jax.tree.map(lambda x: batch_sharding(mesh, x.ndim), shape.slots)
        axes = self.decode_ops.paged_axes(shape.slots.cache)
        cache = PagedKV(
            *(
                None if x is None else logical(a, x)
                for a, x in zip(axes, shape.slots.cache, strict=True)
            )
        )
        pool = jax.tree.map(lambda x: batch_sharding(mesh, x.ndim), shape.pool)
        pool_cache = KVCache(*(logical(KVCache.LOGICAL_AXES, x) for x in shape.pool.cache))
        return EngineState(
            slots=dataclasses.replace(slots, cache=cache),
            pool=dataclasses.replace(pool, cache=pool_cache),
        )

    # ---- compiled bodies ------------------------------------------------------------------

    def _init_impl(self) -> EngineState:
        """Empty slots (done, not real) and an empty pool: a fill, no model code."""
        return _empty_state(self._empty_geometry())

    def _empty_geometry(self) -> _Empty:
        spec = self.spec
        dt = dtype_of(spec.compute_dtype)
        L, S, K, hd = spec.num_layers, self.slots, spec.num_kv_heads, spec.head_dim
        layout = self.decode_ops.paged_shapes(
            kv_heads=K,
            layers=L,
            pages=self.kv_pages,
            page=self.page_size,
            head_dim=hd,
            dtype=dt,
            quantized=self.kv_quant == "int8",
        )
        key_data = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        return _Empty(
            slots=S,
            prompt_len=self.prompt_len,
            gen_len=self.gen_len,
            pad_id=self.pad_id,
            cache=tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in jax.tree.leaves(layout)),
            table=(self.row_pages, self.shard_pages),
            pool=(L, self.pool_size, K, self.prefix_slots, hd),
            dtype=jnp.dtype(dt).name,
            key=(tuple(key_data.shape), jnp.dtype(key_data.dtype).name),
        )

    def _prefill(self, params, prompt_pt, lens_p, bucket: int) -> Prefix:
        """Prompts [P, prompt_len] left-padded, of at most `bucket` tokens: every token but
        the last through the model, into a cache whose slots are the decode cache's."""
        model = self._model(params)
        P, Tp = prompt_pt.shape
        W = self.prefix_slots
        kv_start = Tp - lens_p
        cache = model.init_cache(P, W)
        if bucket > 1:
            first = Tp - bucket  # slots before it are padding of every prompt here
            slots = first + jnp.arange(bucket - 1)
            positions = jnp.maximum(slots[None, :] - kv_start[:, None], 0)
            kv_valid = jnp.arange(W)[None, :] >= kv_start[:, None]  # [P, W]
            _, cache = model(
                prompt_pt[:, first : Tp - 1],
                positions,
                kv_valid_bs=kv_valid,
                cache=cache,
                cache_index=first,
            )
        return Prefix(cache=cache, prompt_tokens=prompt_pt, kv_start=kv_start)

    def _prefill_insert_impl(
        self,
        params,
        state: EngineState,
        prompt_pt,
        lens_p,
        into_p,
        prefill,
        slot_i,
        source_i,
        row_ids_i,
        group_ids_i,
        limits_i,
        pages_i,
        key,
        *,
        bucket: int,
    ) -> EngineState:
        """If `prefill`: prompts [P] into pool entries into_p (Q: padding, dropped). Then
        each of the I insert entries (S: none) puts a new row into slot slot_i[i]: pool
        entry source_i[i]'s prompt, its keys and values copied into its pages pages_i[i]
        [R] (entries in blocks per batch shard, each into its shard's slots)."""
        cfg, ops = self.cfg, self.decode_ops
        S, Q = self.slots, self.pool_size

        def merge(pool: Prefix, prompt_pt, lens_p, into_p) -> Prefix:
            new = self._prefill(params, prompt_pt, lens_p, bucket)
            hit = into_p[None, :] == jnp.arange(Q)[:, None]  # [Q, P]
            which, got = jnp.argmax(hit, axis=1), jnp.any(hit, axis=1)
            cache = KVCache(
                *(
                    jnp.where(got[None, :, None, None, None], jnp.take(x, which, axis=1), old)
                    for x, old in zip(new.cache, pool.cache, strict=True)
                )
            )
            return Prefix(
                cache=cache,
                prompt_tokens=jnp.where(got[:, None], new.prompt_tokens[which], pool.prompt_tokens),
                kv_start=jnp.where(got, _take_vector(new.kv_start, which), pool.kv_start),
            )

        def fill(pool: Prefix) -> Prefix:
            q = self.prefill_block
            nb = -(-prompt_pt.shape[0] // q)
            if nb == 1:
                return merge(pool, prompt_pt, lens_p, into_p)
            # Blocks of q prompts (the last padded: padding goes past the pool); a block
            # with no new prompt (new prompts come first) is skipped.
            pad = nb * q - prompt_pt.shape[0]
            blocks = (
                jnp.pad(prompt_pt, ((0, pad), (0, 0)), constant_values=self.pad_id),
                jnp.pad(lens_p, (0, pad), constant_values=1),
                jnp.pad(into_p, (0, pad), constant_values=Q),
            )
            blocks = tuple(x.reshape(nb, q, *x.shape[1:]) for x in blocks)

            def block(pool, x):
                needed = jnp.any(x[2] < Q)
                return jax.lax.cond(needed, lambda p: merge(p, *x), lambda p: p, pool), None

            pool, _ = loops.scan(block, pool, blocks, name="prefill_blocks")
            return pool

        pool = jax.lax.cond(prefill, fill, lambda p: p, state.pool)

        s = state.slots
        kv_start_i = _take_vector(pool.kv_start, source_i)
        # Each entering row's prompt from its first real token (position 0) on: its
        # pages hold positions, not the pool's left-padded slots. [L, I, K, W, hd]
        W = self.prefix_slots
        at = jnp.minimum(kv_start_i[:, None] + jnp.arange(W), W - 1)[None, :, None, :, None]
        k, v = (jnp.take_along_axis(x.take(source_i, axis=1), at, axis=3) for x in pool.cache)
        layout = self._paged_layout()
        cache = ops.write_prompt(s.cache, k, v, pages_i, slot_i < S, layout=layout)
        cache = self._cache_layout(cache)
        I = slot_i.shape[0]
        if self.interrupt:
            interrupt_at = interrupt_lengths(key, row_ids_i, cfg.interrupt_lo, cfg.interrupt_hi)
        else:
            interrupt_at = jnp.full((I,), _NO_INTERRUPT, jnp.int32)
        prompts = pool.prompt_tokens[source_i]
        zeros = jnp.zeros((I,), jnp.int32)
        Tg = self.gen_len
        fresh = {
            "prompt_tokens": prompts,
            "kv_start": kv_start_i,
            "tokens": jnp.full((I, Tg), self.pad_id, jnp.int32),
            "logprobs": jnp.zeros((I, Tg), jnp.float32),
            "versions": jnp.full((I, Tg), -1, jnp.int32),
            "injected": jnp.zeros((I, Tg), bool),
            "last_token": prompts[:, -1],
            "step": zeros,
            "limit": limits_i,
            "done": jnp.zeros((I,), bool),
            "finish": zeros + int(FinishReason.RUNNING),
            "truncated": jnp.zeros((I,), bool),
            "lengths": zeros,
            "phase": zeros + THINK,
            "phase_pos": zeros,
            "interrupt_at": interrupt_at,
            "keys": jax.random.key_data(row_keys(key, row_ids_i)),
            "group_ids": group_ids_i,
            "row_ids": row_ids_i,
            "real": jnp.ones((I,), bool),
            "pages": pages_i,
        }

        def put(old, x):  # entry i into slot slot_i[i]; S: dropped
            if I == S:  # entry i is slot i: a select (a scatter moved 9% more bytes on TPU)
                mask = (slot_i < S).reshape((S,) + (1,) * (x.ndim - 1))
                return self._rows(jnp.where(mask, x.astype(old.dtype), old))
            return self._rows(old.at[slot_i].set(x.astype(old.dtype), mode="drop"))

        rows = {k: put(getattr(s, k), v) for k, v in fresh.items()}
        return EngineState(slots=dataclasses.replace(s, cache=cache, **rows), pool=pool)

    def _prepare_impl(self, params) -> DecodeWeights:
        return DecodeWeights(
            decode_weights(self.spec, dict(params), self.positions, ops=self.decode_ops)
        )

    def _generate_impl(
        self, weights: DecodeWeights, state: EngineState, version, refill_at, *, steps: int
    ):
        ops = self.decode_ops
        weights = weights.tree
        typed = dataclasses.replace(state.slots, keys=jax.random.wrap_key_data(state.slots.keys))
        slots, rows, ran = self._over_rows(
            lambda w, s, v, r, *, manual: self._chunk(ops, w, s, v, r, steps, manual=manual),
            weights,
            typed,
            jnp.asarray(version, jnp.int32),
            jnp.asarray(refill_at, jnp.int32),
            outs=1,
            row_outs=1,
        )
        slots = dataclasses.replace(slots, keys=jax.random.key_data(slots.keys))
        return dataclasses.replace(state, slots=slots), rows, ran

    def _chunk(self, ops: Decode, weights, state, version, refill_at, steps: int, *, manual):
        """Up to `steps` decode steps of every slot, fewer once every slot is done or
        `refill_at` rows have ended in the chunk (of this device's rows, in proportion,
        if `manual`); also the chunk's columns and end flags of every slot and the steps
        run."""
        greedy = self.cfg.temperature <= 0
        # This chunk's draws of every slot, [S, steps], from each row's own step on: a
        # row active at step i of the chunk is at its step state.step + i.
        u_bn = None if greedy else row_step_uniforms(state.keys, state.step, steps)
        last_prompt_slot = self.prompt_len - 1

        local = state.done.shape[0]
        need = (refill_at * local + self.slots - 1) // self.slots

        def cond(c):
            i, s = c
            ended = jnp.sum(s.done & ~state.done)
            return (i < steps) & ~jnp.all(s.done) & (ended < need)

        def body(c):
            i, s = c
            u_b = None if greedy else jax.lax.dynamic_index_in_dim(u_bn, i, 1, False)
            slot_b = last_prompt_slot + s.step
            return i + 1, self._token_step(ops, weights, s, slot_b, u_b, version, manual=manual)

        i, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        cols = jnp.minimum(state.step[:, None] + jnp.arange(steps), self.gen_len - 1)
        rows = {k: jnp.take_along_axis(getattr(out, k), cols, axis=1) for k in _COLUMNS}
        rows.update({k: getattr(out, k) for k in _SLOT_VALUES}, start=state.step)
        return out, rows, self._all_devices_max(i, manual)

    # ---- the verbs ------------------------------------------------------------------------

    def init(self) -> EngineState:
        """S empty slots (every one free) and an empty prefix pool."""
        return self._init()

    @property
    def length_bucket(self) -> int:
        """Prompts are prefilled in buckets of this many tokens (`fixed_shapes`: one)."""
        return self.prompt_len if self.fixed_shapes else self.cfg.length_bucket

    def _check_prompts(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        for i, p in enumerate(prompt_ids):
            if not 0 < len(p) <= self.prompt_len:
                raise ConfigError(
                    f"prompt {i} has {len(p)} tokens; the engine takes 1 to prompt_len="
                    f"{self.prompt_len}: raise sampling.max_prompt_len or shorten the prompt"
                )

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
            bucket=self._last_bucket,
        )

    def _check_insert(self, prompts, into, slots, sources, row_ids, group_ids, pages, limits):
        """`prefill_insert`'s arguments checked (ValueError naming what is wrong); the rows'
        limits ([m], cfg.max_new_tokens where not given)."""
        P, Q, S = self.prefill_prompts, self.pool_size, self.slots
        if len(prompts) > P or len(into) != len(prompts):
            raise ValueError(f"prefill takes 0 to {P} prompts with a pool entry each")
        m = len(slots)
        if not m <= S or not len(sources) == len(row_ids) == len(group_ids) == m:
            raise ValueError(f"insert takes 0 to {S} rows, with one source and id each")
        lim = np.full((m,), self.cfg.max_new_tokens) if limits is None else np.asarray(limits)
        if m and (lim.shape != (m,) or lim.min() < 1 or lim.max() > self.cfg.max_new_tokens):
            raise ValueError(
                f"limits: {m} values in [1, {self.cfg.max_new_tokens}] (max_new_tokens)"
            )
        bad = [i for i in (*into, *sources) if not 0 <= i < Q]
        if bad or len(set(slots)) != m or any(not 0 <= s < S for s in slots):
            raise ValueError(f"pool entries are in [0, {Q}), slots distinct in [0, {S})")
        R, N = self.row_pages, self.shard_pages
        if len(pages) != m or any(
            not 0 < len(p) <= R or not all(0 <= i < N for i in p) for p in pages
        ):
            raise ValueError(f"pages: a list of 1 to {R} page ids in [0, {N}) for each row")
        return lim

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

    def _row_arrays(self, slots, sources, row_ids, group_ids, lim, pages) -> tuple:
        """The insert's host arrays, one entry per insert row (`_insert_entries`): slot
        (S: no row), source, row id, group id, limit, and its page table [I, R] (N: no
        page)."""
        I, R, N, S = self.insert_rows, self.row_pages, self.shard_pages, self.slots
        entry = self._insert_entries(slots)
        table = np.full((I, R), N, np.int32)
        for e, p in zip(entry, pages, strict=True):
            table[e, : len(p)] = p
        slot_i = np.full((I,), S, np.int32)
        source_i, row_i, group_i = (np.zeros((I,), np.int32) for _ in range(3))
        limit_i = np.ones((I,), np.int32)
        slot_i[entry], source_i[entry], row_i[entry], group_i[entry], limit_i[entry] = (
            slots,
            sources,
            row_ids,
            group_ids,
            lim,
        )
        return slot_i, source_i, row_i, group_i, limit_i, table

    def _insert_entries(self, slots: Sequence[int]) -> np.ndarray:
        """The insert entry of each row entering `slots`: entries come in one block of
        insert_rows / shards per batch shard, a row in its slot's shard's block (with
        an entry for every slot, the slot's own)."""
        if self.insert_rows == self.slots:
            return np.asarray(slots, np.int64)
        per, width = self.insert_rows // self.shards, self.slots // self.shards
        shard = np.asarray(slots, np.int64) // width
        entry = np.empty((len(slots),), np.int64)
        for sh in np.unique(shard):
            at = np.flatnonzero(shard == sh)
            if len(at) > per:
                raise ValueError(
                    f"insert takes up to {per} rows per batch shard (insert_rows="
                    f"{self.insert_rows} over {self.shards} shards), got {len(at)} on shard {sh}"
                )
            entry[at] = sh * per + np.arange(len(at))
        return entry

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


def _take_vector(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x[idx] for a short vector and indices in range, as a one-hot sum. libtpu 0.0.42
    aborts compiling the gather when x and idx are split over the batch shards one
    element per shard (its AllGatherSimplifier: "Check failed: constant->opcode() ==
    HloOpcode::kConstant"; the engine's prefill with one prompt per shard, e.g. 96
    slots of 16 samples over 16 shards, on v6e-64); the sum compiles there."""
    hit = idx[:, None] == jnp.arange(x.shape[0])[None, :]
    return jnp.sum(jnp.where(hit, x[None, :], 0), axis=1, dtype=x.dtype)


class _Empty(NamedTuple):
    """What an engine's empty state depends on (hashable: engines of one geometry share
    one compiled fill, `_fill_program`)."""

    slots: int
    prompt_len: int
    gen_len: int
    pad_id: int
    cache: tuple  # the paged cache's (shape, dtype) of keys and values
    table: tuple  # (pages per row's table R, pages per batch shard N: a table's "no page")
    pool: tuple  # the pool's cache shape (L, Q, K, W, hd)
    dtype: str  # the pool's dtype
    key: tuple  # a key's data (shape, dtype)


def _empty_state(g: _Empty) -> EngineState:
    S, Q, Tp, Tg, pad = g.slots, g.pool[1], g.prompt_len, g.gen_len, g.pad_id
    zeros = jnp.zeros((S,), jnp.int32)
    slots = SamplerState(
        cache=PagedKV(*(jnp.zeros(shape, dtype) for shape, dtype in g.cache)),
        prompt_tokens=jnp.full((S, Tp), pad, jnp.int32),
        kv_start=zeros,
        tokens=jnp.full((S, Tg), pad, jnp.int32),
        logprobs=jnp.zeros((S, Tg), jnp.float32),
        versions=jnp.full((S, Tg), -1, jnp.int32),
        injected=jnp.zeros((S, Tg), bool),
        last_token=zeros + pad,
        step=zeros,
        limit=zeros + 1,
        done=jnp.ones((S,), bool),
        finish=zeros + int(FinishReason.RUNNING),
        truncated=jnp.zeros((S,), bool),
        lengths=zeros,
        phase=zeros + THINK,
        phase_pos=zeros,
        interrupt_at=zeros + _NO_INTERRUPT,
        keys=jnp.zeros((S, *g.key[0]), g.key[1]),
        group_ids=zeros,
        row_ids=zeros,
        real=jnp.zeros((S,), bool),
        pages=jnp.full((S, g.table[0]), g.table[1], jnp.int32),
    )
    pool = Prefix(
        cache=KVCache(*(jnp.zeros(g.pool, g.dtype) for _ in range(2))),
        prompt_tokens=jnp.full((Q, Tp), pad, jnp.int32),
        kv_start=jnp.zeros((Q,), jnp.int32),
    )
    return EngineState(slots=slots, pool=pool)


@functools.lru_cache(maxsize=64)
def _fill_program(g: _Empty, shardings, options: tuple):
    """The jitted fill of an empty state, one per geometry and layout in a process: a
    trainer's engines (and its tests') compile it once, not once per engine (~0.3 s of
    XLA:CPU each, under the persistent cache's threshold)."""
    return jax.jit(
        functools.partial(_empty_state, g), out_shardings=shardings, compiler_options=dict(options)
    )


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

    def collect(self, out: ChunkOut, rows: np.ndarray) -> None:
        """The rows the chunk ended into their buffers (`rows`: the slots' rows when
        it was dispatched)."""
        ended = self.slots.collect(out, rows)
        for k, v in ended.columns.items():
            self.cols[k][ended.rows] = v
        for k in self.ends:
            self.ends[k][ended.rows] = getattr(ended, k)

    def rollouts(self) -> Rollouts:
        eng = self.engine
        R, Tp = len(self.row_ids), eng.prompt_len
        lens = np.array([len(self.prompts[r // self.G]) for r in range(R)], np.int32)
        prompt_tokens = np.full((R, Tp), eng.pad_id, np.int32)
        for r in range(R):
            prompt_tokens[r, Tp - lens[r] :] = self.prompts[r // self.G]
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
