"""The continuous-batching engine: S decode slots refilled as their rows end.

    engine = Engine(spec, cfg, slots=S, eos_id=eos, pad_id=pad)
    rollouts, stats = engine.run(params, prompt_ids, n=G, seed=0)    # the host loop

or the four verbs the host loop is made of (JetStream's shape):

    state = engine.init()                                  # S empty slots
    prefix = engine.prefill(params, prompts)               # each prompt's KV, once
    state = engine.insert(state, prefix, src, slots, row_ids, group_ids, key=key)
    state, steps = engine.generate(params, state, version=v)   # `chunk` steps of every slot
    rows = engine.finished(state)                          # rows to collect; their slots free

A sampler batch (`Sampler`) decodes until its longest row ends, so a row that ends
early leaves its slot idle (compute used ~ mean length / max length of the batch).
Here a slot whose row ended takes the next row of the queue between chunks: with
long-tailed lengths the slots stay busy (benchmarks/sampler.py --lengths longtail).

Every row has the same cache layout, whatever its slot: its prompt left-padded to
`prompt_len` (the longest prompt's bucket), completion token t at cache slot
prompt_len + t, so each row decodes at its own slot (`decode_step` with a slot per
row). A row's draws come from its key and its own step (`row_step_uniforms`), and no
op mixes rows, so its tokens and log-probs depend only on its key, its prompt and
the weights of each chunk: not on its slot, its neighbours or the slot count
(tests/test_engine.py). Weights are an argument of `generate`: rows in flight keep
the KV cache earlier weights wrote (PipelineRL's in-flight update), and every
token records the version that sampled it.

Compiles: `generate` once per chunk size; `prefill` once per prompt length bucket
(the host loop prefills each prompt in its own bucket, `prefill_prompts` at a
time); `insert` once per row count bucket (powers of two up to S). With
`fixed_shapes` (the trainer's engines) every prompt is prefilled at `prompt_len` and
every insert takes S rows: one program each, whatever the prompts' lengths.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.config.sampling import SamplingConfig
from rl_jax.kernels.xla import Decode
from rl_jax.knobs import ConfigError
from rl_jax.models.decode import decode_weights
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import KVCache, Transformer, init_cache
from rl_jax.runtime import xla_options
from rl_jax.sampling._decoder import Decoder, Params, round_up, state_rollouts, to_host
from rl_jax.sampling._dist import interrupt_lengths, row_keys, row_step_uniforms
from rl_jax.sampling._rollouts import FinishReason, Rollouts
from rl_jax.sampling._sampler import pack_prompts
from rl_jax.sampling._state import THINK, SamplerState
from rl_jax.sharding.rules import Rules

# Slots of a prefix cache are a multiple of this when the decode cache is one piece
# (the CPU kernels' key tiles are 16 slots wide).
_PREFIX_UNIT = 16
_NO_INTERRUPT = np.iinfo(np.int32).max
_NOT_ROWS = ("cache", "keys", "step", "limit")  # state fields `finished` does not return


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Prefilled prompts, ready to be inserted into slots (`Engine.prefill`)."""

    cache: KVCache  # k, v [L, P, K, W, hd]: the prompt's keys at slots < prompt_len - 1
    prompt_tokens: jax.Array  # [P, prompt_len] int32, left-padded
    kv_start: jax.Array  # [P] int32 = prompt_len - prompt length

    @property
    def num_prompts(self) -> int:
        return int(self.kv_start.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    """Weights in the decode step's layout (`Engine.prepare`): made once per version of
    the weights, not once per chunk (on CPU the layout packs every matrix anew)."""

    tree: dict


@dataclasses.dataclass(frozen=True)
class RunStats:
    """What a run of the host loop did (`Engine.run`)."""

    chunks: int  # generate calls
    slot_steps: int  # slots x decode steps run
    kept_tokens: int  # policy tokens of the rollouts (completion_mask)
    decoded_tokens: int  # tokens written, injected ones included
    prefills: int  # prefill calls
    prompts_prefilled: int  # prompts prefilled (each once)

    @property
    def occupancy(self) -> float:
        """The fraction of slot-steps that produced a kept token."""
        return self.kept_tokens / max(self.slot_steps, 1)


class Engine(Decoder):
    """Continuous-batching sampling; see the module docstring.

    slots: S, the decode slots (a multiple of the mesh's batch shards).
    chunk: decode steps per `generate` call (default `cfg.decode_chunk`, else 16).
    prefill_prompts: prompts per `prefill` call (fewer are padded): a fixed shape, so a
    prompt's KV does not depend on how many prompts were prefilled with it (XLA:CPU's
    prefill matmuls round differently for different row counts; measured in
    tests/test_engine.py).
    prompt_len: the longest prompt (default `cfg.max_prompt_len`), rounded up to
    `cfg.length_bucket`. Generations are up to `cfg.max_new_tokens` (per-row limits
    may be lower).
    fixed_shapes: prefill every prompt at `prompt_len` and insert S rows at a time
    (padding rows dropped): one prefill and one insert program instead of one per
    length bucket and per row count (more padding computed in exchange).
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
        fixed_shapes: bool = False,
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
        self.fixed_shapes = bool(fixed_shapes)
        self.prompt_len = round_up(longest, cfg.length_bucket)
        self.gen_len = round_up(cfg.max_new_tokens, cfg.length_bucket)
        if longest + cfg.max_new_tokens > self.spec.max_position:
            raise ConfigError(
                f"prompt_len ({longest}) + sampling.max_new_tokens ({cfg.max_new_tokens}) "
                f"exceeds the model's max_position={self.spec.max_position}"
            )
        opts = xla_options(mesh)
        self._init = jax.jit(self._init_impl, compiler_options=opts)
        self._prefill = jax.jit(
            self._prefill_impl, static_argnames=("bucket",), compiler_options=opts
        )
        self._insert = jax.jit(self._insert_impl, donate_argnames=("state",), compiler_options=opts)
        self._prepare = jax.jit(self._prepare_impl, compiler_options=opts)
        self._generate = jax.jit(
            self._generate_impl,
            static_argnames=("steps",),
            donate_argnames=("state",),
            compiler_options=opts,
        )

    def compile_counts(self) -> dict[str, int]:
        """Executables compiled so far per function (a test of bounded compiles)."""
        fns = {
            "init": self._init,
            "prefill": self._prefill,
            "insert": self._insert,
            "prepare": self._prepare,
            "generate": self._generate,
        }
        return {name: fn._cache_size() for name, fn in fns.items()}

    def _geometry(self, ops: Decode) -> tuple[int, int, int, int]:
        """(cache slots C, block, prefix slots W, the prefix's block): the decode cache
        holds prompt_len + gen_len slots; a prefix holds the first W >= prompt_len,
        in whole blocks of the decode cache's layout."""
        C, block = ops.cache_blocks(self.prompt_len + self.gen_len)
        unit = block if block < C else _PREFIX_UNIT
        W = min(round_up(self.prompt_len, unit), C)
        return C, block, W, (block if block < C else W)

    # ---- compiled bodies ------------------------------------------------------------------

    def _init_impl(self) -> SamplerState:
        S, Tp, Tg = self.slots, self.prompt_len, self.gen_len
        ops = self.decode_ops
        C, block, _, _ = self._geometry(ops)
        empty = init_cache(self.spec, S, C, mesh=self.mesh, rules=self.rules)
        cache = self._cache_layout(ops.from_model_cache(empty, block))
        zeros = jnp.zeros((S,), jnp.int32)
        rows = self._rows
        return SamplerState(
            cache=cache,
            prompt_tokens=rows(jnp.full((S, Tp), self.pad_id, jnp.int32)),
            kv_start=rows(zeros),
            tokens=rows(jnp.full((S, Tg), self.pad_id, jnp.int32)),
            logprobs=rows(jnp.zeros((S, Tg), jnp.float32)),
            versions=rows(jnp.full((S, Tg), -1, jnp.int32)),
            injected=rows(jnp.zeros((S, Tg), bool)),
            last_token=rows(zeros + self.pad_id),
            step=rows(zeros),
            limit=rows(zeros + 1),
            done=rows(jnp.ones((S,), bool)),
            finish=rows(zeros + int(FinishReason.RUNNING)),
            truncated=rows(jnp.zeros((S,), bool)),
            lengths=rows(zeros),
            phase=rows(zeros + THINK),
            phase_pos=rows(zeros),
            interrupt_at=rows(zeros + _NO_INTERRUPT),
            keys=rows(row_keys(jax.random.key(0), zeros)),
            group_ids=rows(zeros),
            row_ids=rows(zeros),
            real=rows(jnp.zeros((S,), bool)),
        )

    def _prefill_impl(self, params, prompt_pt, lens_p, *, bucket: int) -> Prefix:
        """Prompts [P, prompt_len] left-padded, of at most `bucket` tokens: every token but
        the last through the model, into a cache whose slots are the decode cache's."""
        model = self._model(params)
        P, Tp = prompt_pt.shape
        _, _, W, _ = self._geometry(self.decode_ops)
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

    def _insert_impl(
        self, state: SamplerState, prefix: Prefix, src, dst, row_ids, group_ids, limits, key
    ) -> SamplerState:
        """Rows m: prompt src[m] of `prefix` into slot dst[m] (dst = S: padding, dropped)."""
        cfg, ops = self.cfg, self.decode_ops
        _, _, _, pblock = self._geometry(ops)
        m = dst.shape[0]
        Tg = self.gen_len
        new = ops.from_model_cache(prefix.cache.take(src), pblock)  # [L, m, ...] first W slots

        def place(c, x):  # rows dst, the leading part of every other axis
            if x.ndim < c.ndim:  # a prefix of one block comes back whole: [.., N = 1, ..]
                x = jnp.expand_dims(x, 2)
            where = (slice(None), dst, *(slice(0, d) for d in x.shape[2:]))
            return c.at[where].set(x.astype(c.dtype), mode="drop")

        cache = self._cache_layout(
            tuple(place(c, x) for c, x in zip(state.cache, new, strict=True))
        )
        if self.interrupt:
            interrupt_at = interrupt_lengths(key, row_ids, cfg.interrupt_lo, cfg.interrupt_hi)
        else:
            interrupt_at = jnp.full((m,), _NO_INTERRUPT, jnp.int32)
        prompts = prefix.prompt_tokens[src]
        zeros = jnp.zeros((m,), jnp.int32)
        fresh = {
            "prompt_tokens": prompts,
            "kv_start": prefix.kv_start[src],
            "tokens": jnp.full((m, Tg), self.pad_id, jnp.int32),
            "logprobs": jnp.zeros((m, Tg), jnp.float32),
            "versions": jnp.full((m, Tg), -1, jnp.int32),
            "injected": jnp.zeros((m, Tg), bool),
            "last_token": prompts[:, -1],
            "step": zeros,
            "limit": limits,
            "done": jnp.zeros((m,), bool),
            "finish": zeros + int(FinishReason.RUNNING),
            "truncated": jnp.zeros((m,), bool),
            "lengths": zeros,
            "phase": zeros + THINK,
            "phase_pos": zeros,
            "interrupt_at": interrupt_at,
            "keys": row_keys(key, row_ids),
            "group_ids": group_ids,
            "row_ids": row_ids,
            "real": jnp.ones((m,), bool),
        }

        def put(old, x):  # (keys are typed: no cast)
            x = x if old.dtype == x.dtype else x.astype(old.dtype)
            return self._rows(old.at[dst].set(x, mode="drop"))

        rows = {k: put(getattr(state, k), v) for k, v in fresh.items()}
        return dataclasses.replace(state, cache=cache, **rows)

    def _prepare_impl(self, params) -> DecodeWeights:
        ops = self.decode_ops
        C = self._geometry(ops)[0]
        return DecodeWeights(decode_weights(self.spec, dict(params), C, ops=ops))

    def _generate_impl(self, weights: DecodeWeights, state, version, refill_at, *, steps: int):
        ops = self.decode_ops
        return self._over_rows(
            lambda w, s, v, r, *, manual: self._chunk(ops, w, s, v, r, steps, manual=manual),
            weights.tree,
            state,
            jnp.asarray(version, jnp.int32),
            jnp.asarray(refill_at, jnp.int32),
            outs=1,
        )

    def _chunk(self, ops: Decode, weights, state, version, refill_at, steps: int, *, manual):
        """Up to `steps` decode steps of every slot, fewer once every slot is done or
        `refill_at` slots are (of this device's rows, in proportion, if `manual`); also
        the steps run."""
        greedy = self.cfg.temperature <= 0
        # This chunk's draws of every slot, [S, steps], from each row's own step on: a
        # row active at step i of the chunk is at its step state.step + i.
        u_bn = None if greedy else row_step_uniforms(state.keys, state.step, steps)
        last_prompt_slot = self.prompt_len - 1

        local = state.done.shape[0]
        need = (refill_at * local + self.slots - 1) // self.slots

        def cond(c):
            i, s = c
            return (i < steps) & ~jnp.all(s.done) & (jnp.sum(s.done) < need)

        def body(c):
            i, s = c
            u_b = None if greedy else jax.lax.dynamic_index_in_dim(u_bn, i, 1, False)
            slot_b = last_prompt_slot + s.step
            return i + 1, self._token_step(ops, weights, s, slot_b, u_b, version, manual=manual)

        i, out = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        return out, self._all_devices_max(i, manual)

    # ---- the four verbs -------------------------------------------------------------------

    def init(self) -> SamplerState:
        """S empty slots (every one free)."""
        return self._init()

    def prefill(self, params: Params | Transformer, prompt_ids: Sequence[Sequence[int]]) -> Prefix:
        """Each prompt's KV cache, computed once (for all of its samples): up to
        `prefill_prompts` prompts (padded with one-token prompts), in the length bucket of
        the longest. A prompt's KV depends only on it and on that bucket."""
        P = len(prompt_ids)
        if not 0 < P <= self.prefill_prompts:
            raise ValueError(f"prefill takes 1 to {self.prefill_prompts} prompts, got {P}")
        self._check_prompts(prompt_ids)
        rows = self.prefill_prompts
        packed, lens_p = pack_prompts(
            prompt_ids, rows=rows, bucket=self.length_bucket, max_len=0, pad_id=self.pad_id
        )
        bucket = packed.shape[1]
        prompt_pt = np.full((rows, self.prompt_len), self.pad_id, np.int32)
        prompt_pt[:, self.prompt_len - bucket :] = packed
        return self._prefill(
            self._as_params(params), *self._put_rows(prompt_pt, lens_p), bucket=bucket
        )

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

    def insert(
        self,
        state: SamplerState,
        prefix: Prefix,
        src: Sequence[int],
        slots: Sequence[int],
        row_ids: Sequence[int],
        group_ids: Sequence[int],
        *,
        key: jax.Array,
        limits: Sequence[int] | None = None,
    ) -> SamplerState:
        """Rows into free slots: row j samples prompt src[j] of `prefix` in slot
        slots[j], its draws keyed by fold_in(key, row_ids[j]); limits[j] its
        max new tokens (default cfg.max_new_tokens). `state` is donated."""
        m = len(src)
        if not 0 < m <= self.slots or not len(slots) == len(row_ids) == len(group_ids) == m:
            raise ValueError(f"insert needs 1 to {self.slots} rows, with one slot and id each")
        lim = np.full((m,), self.cfg.max_new_tokens) if limits is None else np.asarray(limits)
        if lim.shape != (m,) or lim.min() < 1 or lim.max() > self.cfg.max_new_tokens:
            raise ValueError(
                f"limits: {m} values in [1, {self.cfg.max_new_tokens}] (max_new_tokens)"
            )
        mb = self.slots if self.fixed_shapes else min(_pow2(m), self.slots)
        pad = mb - m

        def arr(x, fill):
            return np.concatenate([np.asarray(x, np.int32), np.full((pad,), fill, np.int32)])

        return self._insert(
            state,
            prefix,
            arr(src, 0),
            arr(slots, self.slots),  # padding rows go past the last slot: dropped
            arr(row_ids, 0),
            arr(group_ids, 0),
            arr(lim, 1),
            key,
        )

    def prepare(self, params: Params | Transformer) -> DecodeWeights:
        """The weights in the decode layout, for `generate` (once per version)."""
        return self._prepare(self._as_params(params))

    def generate(
        self,
        params: Params | Transformer | DecodeWeights,
        state: SamplerState,
        *,
        version: int = 0,
        refill_at: int | None = None,
    ) -> tuple[SamplerState, int]:
        """`chunk` decode steps of every slot, fewer if every slot ends first, or once
        `refill_at` slots are done (time to refill them); tokens sampled here carry
        `version`. Returns the state (`state` is donated) and the steps run (one small
        device-to-host read)."""
        weights = params if isinstance(params, DecodeWeights) else self.prepare(params)
        at = self.slots + 1 if refill_at is None else int(refill_at)
        state, steps = self._generate(
            weights, state, np.int32(version), np.int32(at), steps=self.chunk
        )
        return state, int(steps)

    def finished(self, state: SamplerState, among=None) -> dict[str, np.ndarray]:
        """The rows that have ended (`done` and `real`), on the host: `slot` their slot
        indices and each row field of the state (tokens, log-probs, versions, flags).
        `among`: only these slots (default all)."""
        done = to_host(state.done & state.real)
        if among is not None:
            done = done & np.isin(np.arange(self.slots), among)
        idx = np.flatnonzero(done)
        names = [f.name for f in dataclasses.fields(state) if f.name not in _NOT_ROWS]
        rows = to_host({k: getattr(state, k)[idx] for k in names}) if len(idx) else {}
        return {"slot": idx, **rows}

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
    ) -> tuple[Rollouts, RunStats]:
        """Sample n rollouts of each prompt: R = P * n rows, row r = p * n + s of prompt
        p, its draws keyed by fold_in(key, row_ids[r]) (default r). Rows enter free
        slots in `order` (a permutation of range(R), default in order); each prompt is
        prefilled once, when its first row enters. `weights(chunk)` -> (params, version) gives the
        weights of each chunk (default: `params`, `version` throughout).
        `max_new_tokens`: one limit for all rows or one per row. A chunk ends early
        once `refill_min` slots are free while rows wait (default S / 64). Returns the
        rollouts in row order and the run's `RunStats`."""
        G = self.cfg.n if n is None else int(n)
        P = len(prompt_ids)
        if P == 0 or G < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {P} prompts, n={G}")
        R = P * G
        limits = np.broadcast_to(
            np.asarray(self.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens), (R,)
        )
        self._check_prompts(prompt_ids)
        queue = collections.deque(range(R) if order is None else [int(r) for r in order])
        if sorted(queue) != list(range(R)):
            raise ValueError(f"order must be a permutation of range({R})")
        key = jax.random.key(seed) if key is None else key
        ids = np.arange(R) if row_ids is None else np.asarray(row_ids, np.int64)
        if ids.shape != (R,):
            raise ValueError(f"row_ids needs {R} ids (prompts x n), got shape {ids.shape}")
        loop = _HostLoop(self, prompt_ids, G, key, limits, queue, ids)
        refill_min = max(1, self.slots // 64) if refill_min is None else int(refill_min)
        state = self.init()
        chunk, prepared = 0, (None, None)
        while queue or loop.busy():
            if weights is not None:  # this chunk's weights prefill its new rows too
                params, version = weights(chunk)
            if prepared[0] is not params:  # a new version: its decode layout, once
                prepared = (params, self.prepare(params))
            state = loop.refill(params, state)
            at = refill_min if queue else None
            state, steps = self.generate(prepared[1], state, version=version, refill_at=at)
            chunk += 1
            loop.slot_steps += self.slots * steps
            loop.collect(self.finished(state, among=np.flatnonzero(loop.slot_row >= 0)))
        return loop.rollouts(), loop.stats(chunk)


class _HostLoop:
    """The host side of `Engine.run`: which row is in which slot, prefixes waiting for
    their prompt's remaining rows, rows collected."""

    def __init__(self, engine: Engine, prompt_ids, G: int, key, limits, queue, row_ids):
        self.engine, self.prompts, self.G = engine, prompt_ids, G
        self.key, self.limits, self.row_ids = key, limits, row_ids
        self.queue = queue
        self.slot_row = np.full((engine.slots,), -1)
        self.left = collections.Counter(r // G for r in queue)  # rows not yet inserted
        self.prefixes: dict[int, tuple[Prefix, int]] = {}  # prompt -> (prefix, index)
        self.rows: dict[int, dict] = {}
        self.slot_steps = self.prefills = self.prefilled = 0

    def busy(self) -> bool:
        return bool((self.slot_row >= 0).any())

    def refill(self, params, state: SamplerState) -> SamplerState:
        free = np.flatnonzero(self.slot_row < 0)
        take = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        if not take:
            return state
        new = list(dict.fromkeys(r // self.G for r in take if r // self.G not in self.prefixes))
        bucket = self.engine.length_bucket
        by_bucket = collections.defaultdict(list)  # each prompt in its own length bucket
        for p in new:
            by_bucket[round_up(len(self.prompts[p]), bucket)].append(p)
        per_call = self.engine.prefill_prompts
        for group in by_bucket.values():
            for at in range(0, len(group), per_call):
                part = group[at : at + per_call]
                prefix = self.engine.prefill(params, [self.prompts[p] for p in part])
                self.prefills += 1
                self.prefilled += len(part)
                self.prefixes.update({p: (prefix, i) for i, p in enumerate(part)})
        by_prefix: dict[int, tuple[Prefix, list]] = {}
        for r, slot in zip(take, free, strict=False):
            prefix, i = self.prefixes[r // self.G]
            by_prefix.setdefault(id(prefix), (prefix, []))[1].append((i, int(slot), r))
            self.slot_row[slot] = r
            self.left[r // self.G] -= 1
            if self.left[r // self.G] == 0:
                del self.prefixes[r // self.G]
        for prefix, rows in by_prefix.values():
            src, slots, rs = (list(c) for c in zip(*rows, strict=True))
            state = self.engine.insert(
                state,
                prefix,
                src,
                slots,
                [int(self.row_ids[r]) for r in rs],
                [r // self.G for r in rs],
                key=self.key,
                limits=[int(self.limits[r]) for r in rs],
            )
        return state

    def collect(self, done: dict[str, np.ndarray]) -> None:
        for j, slot in enumerate(done["slot"]):
            r = int(self.slot_row[slot])
            if r < 0:
                continue  # already collected; the slot waits for a row
            self.rows[r] = {k: v[j] for k, v in done.items() if k != "slot"}
            self.slot_row[slot] = -1

    def rollouts(self) -> Rollouts:
        rows = [self.rows[r] for r in range(len(self.rows))]
        return state_rollouts({k: np.stack([row[k] for row in rows]) for k in rows[0]})

    def stats(self, chunks: int) -> RunStats:
        kept = sum(int((~row["injected"][: row["lengths"]]).sum()) for row in self.rows.values())
        return RunStats(
            chunks=chunks,
            slot_steps=self.slot_steps,
            kept_tokens=kept,
            decoded_tokens=sum(int(row["lengths"]) for row in self.rows.values()),
            prefills=self.prefills,
            prompts_prefilled=self.prefilled,
        )
