"""The engine's device side, in three layers: `EngineGeometry` (slots, lengths, pages,
the state and its layout on the mesh; a call's host arguments checked and laid out),
`EngineBodies` (what the programs compute: prefill and insert, the weights' decode
layout, a chunk of decode steps) and `EnginePrograms` (the constructor, the bodies
jitted, the programs' views for the planner). `Engine` (`_engine.py`) is the host side
that calls them; its module docstring describes the whole engine.
"""

from __future__ import annotations

import dataclasses
import functools
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
from rl_jax.models.moe import route_dtype
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import KVCache, Transformer, dtype_of
from rl_jax.runtime import xla_options
from rl_jax.sampling._decoder import Decoder, round_up
from rl_jax.sampling._dist import interrupt_lengths, row_keys, row_step_uniforms
from rl_jax.sampling._rollouts import FinishReason
from rl_jax.sampling._slots import COLUMNS
from rl_jax.sampling._state import THINK, SamplerState
from rl_jax.sharding.rules import BATCH_AXES, Rules, batch_sharding, fit_spec, logical_to_spec

_NO_INTERRUPT = np.iinfo(np.int32).max
KV_QUANT = (None, "int8")  # the engine's KV cache: the compute dtype, or int8 with scales
# The per-slot values of the chunk `generate` returns, beside its columns (`COLUMNS`).
_SLOT_VALUES = ("done", "lengths", "finish", "truncated")
# A slot's fields but its cache, in the state's order.
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(SamplerState))[1:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Prefilled prompts: the pool rows are inserted from (`Engine.prefill_insert`)."""

    cache: KVCache  # k, v [L, Q, K, W, hd]: the prompt's keys at slots < prompt_len - 1
    prompt_tokens: jax.Array  # [Q, prompt_len] int32, left-padded
    kv_start: jax.Array  # [Q] int32 = prompt_len - prompt length
    # [Q, prompt_len, L, k] each prompt token's experts (`record_routes`; else None);
    # the last prompt token's come from the first decode step.
    routes: jax.Array | None = None

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


class DecodeWeights(NamedTuple):
    """Weights in the decode step's layout (`Engine.prepare`): stacked over layers, the
    projections fused, laid out by the platform's kernels. `generate` takes them as
    they are; made from params, they cost a pass over the weights."""

    tree: dict


class EngineGeometry(Decoder):
    """The engine's sizes and layouts (its arguments are `Engine`'s, documented there):
    slots, prefill and insert batches, prompt and generation lengths, the paged cache's
    pages, the empty state and its layout on the mesh; and the host's arguments of a
    call checked against them and laid out into the programs' row entries."""

    def _set_sizes(
        self,
        slots: int,
        chunk: int | None,
        prompt_len: int | None,
        prefill_prompts: int,
        prefill_block: int | None,
        insert_rows: int | None,
        fixed_shapes: bool,
    ) -> None:
        """The slots, the prefill's and the insert's batches, the prompt and generation
        lengths."""
        cfg = self.cfg
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

    def _set_pages(self, page_size: int | None, kv_pages: int | None, kv_quant: str | None):
        """The paged cache's geometry: its dtype, page size, pages per row's table (R, a
        longest row's), pages per batch shard."""
        if kv_quant not in KV_QUANT:
            raise ConfigError(
                f"engine kv_quant={kv_quant!r}: one of {', '.join(map(str, KV_QUANT))}"
            )
        self.kv_quant = kv_quant
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

    @property
    def positions(self) -> int:
        """Positions a row may reach (its rotary table's rows)."""
        return self.prompt_len + self.gen_len

    @property
    def length_bucket(self) -> int:
        """Prompts are prefilled in buckets of this many tokens (`fixed_shapes`: one)."""
        return self.prompt_len if self.fixed_shapes else self.cfg.length_bucket

    # ---- the state ------------------------------------------------------------------------

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
            routes=(
                (L, spec.num_experts_per_tok, route_dtype(spec.num_experts).name)
                if self.record_routes
                else None
            ),
        )

    # ---- a call's host arguments ----------------------------------------------------------

    def _check_prompts(self, prompt_ids: Sequence[Sequence[int]]) -> None:
        for i, p in enumerate(prompt_ids):
            if not 0 < len(p) <= self.prompt_len:
                raise ConfigError(
                    f"prompt {i} has {len(p)} tokens; the engine takes 1 to prompt_len="
                    f"{self.prompt_len}: raise sampling.max_prompt_len or shorten the prompt"
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

    def _row_arrays(self, slots, sources, row_ids, group_ids, lim, pages) -> tuple:
        """The insert's host arrays, one entry per insert row (`_insert_entries`): slot
        (S: no row), source, row id, group id, limit, and its page table [I, R] (N: no
        page)."""
        I, R, N, S = self.insert_rows, self.row_pages, self.shard_pages, self.slots
        entry = self._insert_entries(slots)
        table = np.full((I, R), N, np.int32)
        for e, p in zip(entry, pages, strict=True):
            table[e, : len(p)] = p
        cols = []  # each entry's slot, source, row id, group id, limit (or of no row)
        for blank, given in ((S, slots), (0, sources), (0, row_ids), (0, group_ids), (1, lim)):
            col = np.full((I,), blank, np.int32)
            col[entry] = given
            cols.append(col)
        return (*cols, table)

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


class EngineBodies(EngineGeometry):
    """The bodies of the engine's programs, as `EnginePrograms` traces them: the prefill
    into the pool and the insert of rows into free slots (`_prefill_insert_impl`), the
    weights' decode layout (`_prepare_impl`), a chunk of decode steps of every slot
    (`_generate_impl`)."""

    def _prefill(self, params, prompt_pt, lens_p, bucket: int) -> Prefix:
        """Prompts [P, prompt_len] left-padded, of at most `bucket` tokens: every token but
        the last through the model, into a cache whose slots are the decode cache's."""
        model = Transformer(self.spec, dict(params), mesh=self.mesh, rules=self.rules)
        P, Tp = prompt_pt.shape
        W = self.prefix_slots
        kv_start = Tp - lens_p
        cache = model.init_cache(P, W)
        if bucket > 1:
            first = Tp - bucket  # slots before it are padding of every prompt here
            slots = first + jnp.arange(bucket - 1)
            positions = jnp.maximum(slots[None, :] - kv_start[:, None], 0)
            kv_valid = jnp.arange(W)[None, :] >= kv_start[:, None]  # [P, W]
            _, cache, *routes = model(
                prompt_pt[:, first : Tp - 1],
                positions,
                kv_valid_bs=kv_valid,
                cache=cache,
                cache_index=first,
                record_routes=self.record_routes,
            )
        if not self.record_routes:
            return Prefix(cache=cache, prompt_tokens=prompt_pt, kv_start=kv_start)
        spec = self.spec
        shape = (P, Tp, spec.num_layers, spec.num_experts_per_tok)
        table = jnp.zeros(shape, route_dtype(spec.num_experts))
        if bucket > 1:
            table = table.at[:, first : Tp - 1].set(routes[0].astype(table.dtype))
        return Prefix(cache=cache, prompt_tokens=prompt_pt, kv_start=kv_start, routes=table)

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
        S = self.slots

        def fill(pool: Prefix) -> Prefix:
            return self._fill_pool(params, pool, prompt_pt, lens_p, into_p, bucket)

        pool = jax.lax.cond(prefill, fill, lambda p: p, state.pool)
        s = state.slots
        kv_start_i = _take_vector(pool.kv_start, source_i)
        cache = self._write_prompts(s.cache, pool, source_i, kv_start_i, slot_i, pages_i)
        fresh = self._fresh_rows(
            pool, source_i, kv_start_i, row_ids_i, group_ids_i, limits_i, pages_i, key
        )
        I = slot_i.shape[0]

        def put(old, x):  # entry i into slot slot_i[i]; S: dropped
            if I == S:  # entry i is slot i: a select (a scatter moved 9% more bytes on TPU)
                mask = (slot_i < S).reshape((S,) + (1,) * (x.ndim - 1))
                return self._rows(jnp.where(mask, x.astype(old.dtype), old))
            return self._rows(old.at[slot_i].set(x.astype(old.dtype), mode="drop"))

        rows = {k: put(getattr(s, k), v) for k, v in fresh.items()}
        return EngineState(slots=dataclasses.replace(s, cache=cache, **rows), pool=pool)

    def _fill_pool(self, params, pool: Prefix, prompt_pt, lens_p, into_p, bucket: int) -> Prefix:
        """The prompts [P] prefilled into pool entries into_p (Q: padding, dropped), in
        blocks of `prefill_block` prompts."""
        Q, q = self.pool_size, self.prefill_block

        def merge(pool: Prefix, prompt_pt, lens_p, into_p) -> Prefix:
            return _merge(pool, self._prefill(params, prompt_pt, lens_p, bucket), into_p)

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

    def _write_prompts(self, cache: PagedKV, pool: Prefix, source_i, kv_start_i, slot_i, pages_i):
        """Each entering row's prompt (pool entry source_i[i]) into its pages pages_i[i]
        (where slot_i[i] is a slot, < S)."""
        # Each entering row's prompt from its first real token (position 0) on: its
        # pages hold positions, not the pool's left-padded slots. [L, I, K, W, hd]
        W = self.prefix_slots
        at = jnp.minimum(kv_start_i[:, None] + jnp.arange(W), W - 1)[None, :, None, :, None]
        k, v = (jnp.take_along_axis(x.take(source_i, axis=1), at, axis=3) for x in pool.cache)
        layout = self._paged_layout()
        cache = self.decode_ops.write_prompt(
            cache, k, v, pages_i, slot_i < self.slots, layout=layout
        )
        return self._cache_layout(cache)

    def _fresh_rows(
        self, pool: Prefix, source_i, kv_start_i, row_ids_i, group_ids_i, limits_i, pages_i, key
    ) -> dict[str, jax.Array]:
        """The entering rows' slot fields [I, ...] (all but the cache): their prompts,
        empty columns, limits, draws' keys and interruption steps, ids and pages."""
        cfg, I = self.cfg, source_i.shape[0]
        if self.interrupt:
            interrupt_at = interrupt_lengths(key, row_ids_i, cfg.interrupt_lo, cfg.interrupt_hi)
        else:
            interrupt_at = jnp.full((I,), _NO_INTERRUPT, jnp.int32)
        prompts = pool.prompt_tokens[source_i]
        fields = _start_fields(I, self.gen_len, self.pad_id, jnp.zeros((I,), jnp.int32))
        fields.update(
            prompt_tokens=prompts,
            kv_start=kv_start_i,
            last_token=prompts[:, -1],
            limit=limits_i,
            done=jnp.zeros((I,), bool),
            interrupt_at=interrupt_at,
            keys=jax.random.key_data(row_keys(key, row_ids_i)),
            group_ids=group_ids_i,
            row_ids=row_ids_i,
            real=jnp.ones((I,), bool),
            pages=pages_i,
        )
        return {k: fields[k] for k in _ROW_FIELDS}  # in the state's order, as inserted

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
            i, s, _ = c
            ended = jnp.sum(s.done & ~state.done)
            return (i < steps) & ~jnp.all(s.done) & (ended < need)

        def body(c):
            i, s, routes = c
            u_b = None if greedy else jax.lax.dynamic_index_in_dim(u_bn, i, 1, False)
            slot_b = last_prompt_slot + s.step
            s, got = self._token_step(ops, weights, s, slot_b, u_b, version, manual=manual)
            if routes is not None:  # step i's fed tokens' experts: column step + i of a row
                routes = routes.at[:, i].set(got.astype(routes.dtype))
            return i + 1, s, routes

        routes = None
        if self.record_routes:  # [S, steps, L, k]
            spec = self.spec
            shape = (local, steps, spec.num_layers, spec.num_experts_per_tok)
            routes = jnp.zeros(shape, route_dtype(spec.num_experts))
        i, out, routes = jax.lax.while_loop(cond, body, (jnp.int32(0), state, routes))
        cols = jnp.minimum(state.step[:, None] + jnp.arange(steps), self.gen_len - 1)
        rows = {k: jnp.take_along_axis(getattr(out, k), cols, axis=1) for k in COLUMNS}
        if routes is not None:
            rows["routes"] = routes
        rows.update({k: getattr(out, k) for k in _SLOT_VALUES}, start=state.step)
        # The steps run: the most of any device's, in a shard_map'd loop.
        return out, rows, jax.lax.pmax(i, BATCH_AXES) if manual else i


class EnginePrograms(EngineBodies):
    """The engine's compiled programs: its constructor (the geometry checked and set,
    the bodies jitted with their layouts and donations) and the programs' views for
    the planner and tests (`programs`, `abstract_decode_weights`, `compile_counts`)."""

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
        record_routes: bool = False,
        mesh=None,
        eos_id: int | Sequence[int] | None = None,
        pad_id: int = 0,
        interrupt_ids: Sequence[int] | None = None,
        rules: str | Rules = "fsdp_tp",
    ):
        """`Engine`'s arguments (documented there): the geometry checked and set, then
        the programs jitted."""
        super().__init__(
            model,
            cfg,
            mesh=mesh,
            eos_id=eos_id,
            pad_id=pad_id,
            interrupt_ids=interrupt_ids,
            rules=rules,
        )
        if record_routes and not self.spec.is_moe:
            raise ConfigError("engine record_routes: this model has no router (a dense MLP)")
        self.record_routes = bool(record_routes)
        self._set_sizes(
            slots, chunk, prompt_len, prefill_prompts, prefill_block, insert_rows, fixed_shapes
        )
        self._set_pages(page_size, kv_pages, kv_quant)
        self._jit_programs()

    def _jit_programs(self) -> None:
        """The programs, jitted: `_init`, `_prefill_insert`, `_prepare`, `_generate`."""
        mesh = self.mesh
        opts = xla_options(mesh, exact_rounding=self.spec.exact_rounding)
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
            rows = {k: batch_sharding(mesh, 2) for k in COLUMNS}
            rows.update({k: batch_sharding(mesh, 1) for k in ("start", *_SLOT_VALUES)})
            if self.record_routes:
                rows["routes"] = batch_sharding(mesh, 4)
            pin = {"out_shardings": (state_sh, rows, NamedSharding(mesh, PartitionSpec()))}
        self._prepare = jax.jit(self._prepare_impl, compiler_options=opts)
        self._generate = jax.jit(
            self._generate_impl,
            static_argnames=("steps",),
            donate_argnames=("state",),
            compiler_options=opts,
            **pin,
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

    def init(self) -> EngineState:
        """S empty slots (every one free) and an empty prefix pool."""
        return self._init()


def _merge(pool: Prefix, new: Prefix, into_p) -> Prefix:
    """The pool with `new`'s prompts [P] in its entries into_p (past the pool: dropped)."""
    Q = pool.num_prompts
    hit = into_p[None, :] == jnp.arange(Q)[:, None]  # [Q, P]
    which, got = jnp.argmax(hit, axis=1), jnp.any(hit, axis=1)
    cache = KVCache(
        *(
            jnp.where(got[None, :, None, None, None], jnp.take(x, which, axis=1), old)
            for x, old in zip(new.cache, pool.cache, strict=True)
        )
    )
    routes = None
    if pool.routes is not None:
        routes = jnp.where(got[:, None, None, None], new.routes[which], pool.routes)
    return Prefix(
        cache=cache,
        prompt_tokens=jnp.where(got[:, None], new.prompt_tokens[which], pool.prompt_tokens),
        kv_start=jnp.where(got, _take_vector(new.kv_start, which), pool.kv_start),
        routes=routes,
    )


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
    routes: tuple | None  # (L, k, dtype) of the pool's recorded experts (record_routes)


def _start_fields(n: int, gen_len: int, pad_id: int, zeros: jax.Array) -> dict[str, jax.Array]:
    """The slot fields [n, ...] every row starts with, an empty slot's too: its columns
    not reached (`COLUMNS`), at step 0 of THINK, running, nothing generated."""
    fields = {
        k: jnp.full((n, gen_len), pad_id if v is None else v, dtype)
        for k, (dtype, v) in COLUMNS.items()
    }
    return fields | dict(
        step=zeros,
        finish=zeros + int(FinishReason.RUNNING),
        truncated=jnp.zeros((n,), bool),
        lengths=zeros,
        phase=zeros + THINK,
        phase_pos=zeros,
    )


def _empty_state(g: _Empty) -> EngineState:
    S, Q, Tp, Tg, pad = g.slots, g.pool[1], g.prompt_len, g.gen_len, g.pad_id
    zeros = jnp.zeros((S,), jnp.int32)
    slots = SamplerState(
        cache=PagedKV(*(jnp.zeros(shape, dtype) for shape, dtype in g.cache)),
        prompt_tokens=jnp.full((S, Tp), pad, jnp.int32),
        kv_start=zeros,
        **_start_fields(S, Tg, pad, zeros),
        last_token=zeros + pad,
        limit=zeros + 1,
        done=jnp.ones((S,), bool),
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
        routes=None if g.routes is None else jnp.zeros((Q, Tp, *g.routes[:2]), g.routes[2]),
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
