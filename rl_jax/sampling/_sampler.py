"""The compiled sampler: prefill once per prompt, then a `lax.while_loop` decode.

    sampler = Sampler(spec, cfg, mesh=mesh, eos_id=eos, pad_id=pad)
    state = sampler.start(params, prompts, n=G, seed=0)              # prefill P prompts
    while not sampler.done(state):
        state = sampler.decode(params, state, max_steps=64, version=v)  # swap params freely
    out = sampler.result(state)                                       # Rollouts, B = P * G

Weights are an argument of both compiled functions: parameters with the same
tree, shapes, dtypes and shardings never recompile, including between decode
chunks while rows are in flight (PipelineRL's in-flight update: the rows keep
the KV cache the old weights wrote). Shapes are bucketed: prompts to a
multiple of `length_bucket` (left-padded), generations to a multiple of it too,
rows to a multiple of the mesh's batch shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from rl_jax.config.sampling import SamplingConfig
from rl_jax.kernels.xla import Decode
from rl_jax.knobs import ConfigError
from rl_jax.models.decode import decode_weights
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import Transformer
from rl_jax.runtime import xla_options
from rl_jax.sampling._decoder import Decoder, Params, round_up, state_rollouts, to_host
from rl_jax.sampling._dist import interrupt_lengths, row_keys, step_uniforms
from rl_jax.sampling._rollouts import FinishReason, Rollouts
from rl_jax.sampling._state import THINK, SamplerState
from rl_jax.sharding.rules import Rules

__all__ = ["Sampler", "pack_prompts", "round_up"]


def pack_prompts(
    prompt_ids: Sequence[Sequence[int]],
    *,
    rows: int,
    bucket: int,
    max_len: int,
    pad_id: int,
    min_len: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts into [rows, Tp] (Tp the longest prompt, at least `min_len`, rounded
    up to a multiple of `bucket`); also their lengths [rows].

    Rows past len(prompt_ids) hold a one-token dummy prompt (padding rows).
    """
    lens = [len(p) for p in prompt_ids]
    for i, n in enumerate(lens):
        if n == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if max_len and n > max_len:  # 0: no limit of its own (auto, checked at start)
            raise ConfigError(
                f"prompt {i} has {n} tokens, more than sampling.max_prompt_len={max_len}; "
                "raise sampling.max_prompt_len or shorten the prompt"
            )
    tp = round_up(max(*lens, min_len), bucket)
    tokens = np.full((rows, tp), pad_id, np.int32)
    lengths = np.ones((rows,), np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, tp - len(p) :] = np.asarray(p, np.int32)
        lengths[i] = len(p)
    return tokens, lengths


class Sampler(Decoder):
    """Batched sampling from a decoder; see the module docstring for the life cycle.

    model: the `ModelSpec` (or a `Transformer`, whose spec is used).
    eos_id: stop token(s) used when `cfg.stop_token_ids` is empty.
    interrupt_ids: the tokenized `cfg.interrupt_text` (needed in interrupt mode).
    rules: a sampling rule preset of `rl_jax.sharding.SAMPLE_RULES` or a rule table.
    """

    def __init__(
        self,
        model: ModelSpec | Transformer,
        cfg: SamplingConfig,
        *,
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
        opts = xla_options(mesh)
        self._start = jax.jit(self._start_impl, static_argnames=("gen_len",), compiler_options=opts)
        self._decode = jax.jit(self._decode_impl, donate_argnames=("state",), compiler_options=opts)

    def compile_counts(self) -> dict[str, int]:
        """Executables compiled so far per function (a test of "no recompilation")."""
        return {"start": self._start._cache_size(), "decode": self._decode._cache_size()}

    # ---- compiled bodies ------------------------------------------------------------------

    def _start_impl(
        self, params, prompt_pt, lens_p, group_b, row_ids_b, real_b, key, limit, *, gen_len
    ) -> SamplerState:
        cfg = self.cfg
        model = self._model(params)
        P, Tp = prompt_pt.shape
        ops = self.decode_ops
        S, block = ops.cache_blocks(Tp + gen_len)
        kv_start_p = Tp - lens_p
        cache = model.init_cache(P, S)
        if Tp > 1:
            # Every prompt token but the last; the first decode step feeds that one.
            slots = jnp.arange(Tp - 1)
            positions = jnp.maximum(slots[None, :] - kv_start_p[:, None], 0)
            kv_valid = jnp.arange(S)[None, :] >= kv_start_p[:, None]  # [P, S]
            _, cache = model(
                prompt_pt[:, : Tp - 1],
                positions,
                kv_valid_bs=kv_valid,
                cache=cache,
                cache_index=0,
            )
        # Share each prompt's prefix with its G samples.
        cache = ops.from_model_cache(cache.take(group_b), block)
        cache = self._cache_layout(cache)
        B = group_b.shape[0]
        if self.interrupt:
            interrupt_at = interrupt_lengths(key, row_ids_b, cfg.interrupt_lo, cfg.interrupt_hi)
        else:
            interrupt_at = jnp.full((B,), jnp.iinfo(jnp.int32).max, jnp.int32)
        prompts_b = prompt_pt[group_b]
        zeros = jnp.zeros((B,), jnp.int32)
        return SamplerState(
            cache=cache,
            prompt_tokens=self._rows(prompts_b),
            kv_start=self._rows(kv_start_p[group_b]),
            tokens=self._rows(jnp.full((B, gen_len), self.pad_id, jnp.int32)),
            logprobs=self._rows(jnp.zeros((B, gen_len), jnp.float32)),
            versions=self._rows(jnp.full((B, gen_len), -1, jnp.int32)),
            injected=self._rows(jnp.zeros((B, gen_len), bool)),
            last_token=self._rows(prompts_b[:, -1]),
            step=jnp.int32(0),
            limit=jnp.asarray(limit, jnp.int32),
            done=self._rows(~real_b),
            finish=self._rows(zeros + int(FinishReason.RUNNING)),
            truncated=self._rows(jnp.zeros((B,), bool)),
            lengths=self._rows(zeros),
            phase=self._rows(zeros + THINK),
            phase_pos=self._rows(zeros),
            interrupt_at=self._rows(interrupt_at),
            keys=self._rows(row_keys(key, row_ids_b)),
            group_ids=self._rows(group_b),
            row_ids=self._rows(row_ids_b),
            real=self._rows(real_b),
        )

    def _decode_impl(self, params, state: SamplerState, max_steps, version) -> SamplerState:
        ops = self.decode_ops
        weights = decode_weights(self.spec, dict(params), ops.cache_slots(state.cache), ops=ops)
        end = jnp.minimum(state.step + max_steps, jnp.max(state.limit))
        version = jnp.asarray(version, jnp.int32)
        return self._over_rows(
            lambda w, s, e, v, *, manual: self._loop(ops, w, s, e, v, manual=manual),
            weights,
            state,
            end,
            version,
        )

    def _loop(
        self, ops: Decode, weights, state: SamplerState, end, version, *, manual: bool
    ) -> SamplerState:
        """Decode until `end` or until every row (of this device, if `manual`) is done."""
        Tp = state.prompt_tokens.shape[1]
        # Every column's draws, made before the loop: [B, Tg] (none for greedy).
        greedy = self.cfg.temperature <= 0
        Tg = state.tokens.shape[1]
        u_bt = None if greedy else step_uniforms(state.keys, jnp.arange(Tg, dtype=jnp.int32))

        def cond(s: SamplerState):
            return (s.step < end) & ~jnp.all(s.done)

        def body(s: SamplerState) -> SamplerState:
            u_b = None if greedy else jax.lax.dynamic_index_in_dim(u_bt, s.step, 1, False)
            return self._token_step(ops, weights, s, Tp - 1 + s.step, u_b, version, manual=manual)

        out = jax.lax.while_loop(cond, body, state)
        # Devices that finished early skipped steps whose columns are padding for all
        # their rows; the shared step counter is the furthest one.
        return dataclasses.replace(out, step=self._all_devices_max(out.step, manual))

    # ---- the trainer's API ----------------------------------------------------------------

    def start(
        self,
        params: Params | Transformer,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int | None = None,
        key: jax.Array | None = None,
        seed: int = 0,
        row_ids: Sequence[int] | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
        prompt_len: int = 0,
    ) -> SamplerState:
        """Prefill P prompts once and give each of its G = n samples a copy: B = P * G rows.

        Row b samples for prompt b // G. Random draws of a row depend only on
        `key` (default `jax.random.key(seed)`), its row id (default b) and the step.
        `max_new_tokens` overrides `cfg.max_new_tokens` for this batch (bucketed), or
        for each row (a sequence of B limits: a row ends at its own, as LENGTH).
        `prompt_len`: prompts are left-padded to at least this many tokens (bucketed;
        0: the longest prompt's bucket), so batches cut from a larger one run its shapes.
        """
        cfg = self.cfg
        G = cfg.n if n is None else int(n)
        P = len(prompt_ids)
        if P == 0 or G < 1:
            raise ValueError(f"need at least one prompt and n >= 1, got {P} prompts, n={G}")
        rows = P * G
        limits = np.asarray(cfg.max_new_tokens if max_new_tokens is None else max_new_tokens)
        if limits.ndim and limits.shape != (rows,):
            raise ValueError(f"max_new_tokens needs {rows} limits (P * n), got {limits.shape}")
        limit = int(limits.max())
        if int(limits.min()) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {int(limits.min())}")
        gen_len = round_up(limit, cfg.length_bucket)
        b_pad, p_pad = round_up(rows, self.shards), round_up(P, self.shards)
        prompt_pt, lens_p = pack_prompts(
            prompt_ids,
            rows=p_pad,
            bucket=cfg.length_bucket,
            max_len=cfg.max_prompt_len,
            pad_id=self.pad_id,
            min_len=prompt_len,
        )
        longest = int(lens_p.max()) + limit
        if longest > self.spec.max_position:
            raise ConfigError(
                f"prompt ({int(lens_p.max())} tokens) + max_new_tokens ({limit}) = {longest} "
                f"exceeds the model's max_position={self.spec.max_position}"
            )
        if row_ids is None:
            ids = np.arange(rows, dtype=np.int32)
        else:
            ids = np.asarray(row_ids, np.int32)
            if ids.shape != (rows,):
                raise ValueError(f"row_ids needs {rows} ids (P * n), got shape {ids.shape}")
        group = np.zeros((b_pad,), np.int32)
        group[:rows] = np.repeat(np.arange(P, dtype=np.int32), G)
        row_ids_b = np.zeros((b_pad,), np.int32)
        row_ids_b[:rows] = ids
        real = np.arange(b_pad) < rows
        key = jax.random.key(seed) if key is None else key
        if limits.ndim:  # per row (padding rows: 1)
            limit_b = np.ones((b_pad,), np.int32)
            limit_b[:rows] = limits
            (limit_arg,) = self._put_rows(limit_b)
        else:
            limit_arg = np.int32(limit)
        return self._start(
            self._as_params(params),
            *self._put_rows(prompt_pt, lens_p, group, row_ids_b, real),
            key,
            limit_arg,
            gen_len=gen_len,
        )

    def start_program(self, params, *, prompts: int, prompt_len: int, max_new_tokens: int):
        """(jitted prefill, abstract args, kwargs) of `start` for `prompts` prompts of
        `prompt_len` tokens and `cfg.n` samples each, laid out as `start` lays them
        out; `decode_program` takes (params, state, max_steps, version) like `decode`.
        `rl_jax.plan` compiles both ahead of time for hardware this host does not have."""
        gen_len = round_up(max_new_tokens, self.cfg.length_bucket)
        tp = round_up(prompt_len, self.cfg.length_bucket)
        p_pad, b_pad = round_up(prompts, self.shards), round_up(prompts * self.cfg.n, self.shards)

        def arr(shape, dtype=jnp.int32):
            if self.mesh is None:
                sh = None
            else:  # rows over the batch axes; the key and the limit replicated
                sh = NamedSharding(self.mesh, self._row_spec(len(shape)))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

        key = jax.eval_shape(jax.random.key, 0)
        args = (params, arr((p_pad, tp)), arr((p_pad,)), arr((b_pad,)), arr((b_pad,)))
        args += (arr((b_pad,), jnp.bool_), arr(key.shape, key.dtype), arr(()))
        return self._start, args, {"gen_len": gen_len}

    @property
    def decode_program(self):
        return self._decode

    def decode(
        self,
        params: Params | Transformer,
        state: SamplerState,
        *,
        max_steps: int | None = None,
        version: int = 0,
    ) -> SamplerState:
        """Decode up to `max_steps` tokens per row (a chunk; None = to the end).

        `state` is donated: use the returned state. Tokens sampled here carry
        `version`. Chunk size and new same-shaped params do not recompile.
        """
        steps = state.tokens.shape[1] if max_steps is None else int(max_steps)
        if steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {max_steps}")
        return self._decode(self._as_params(params), state, np.int32(steps), np.int32(version))

    def done(self, state: SamplerState) -> bool:
        """True when every row has finished (one small device-to-host read)."""
        return bool(jnp.all(state.done) | (state.step >= jnp.max(state.limit)))

    def result(self, state: SamplerState) -> Rollouts:
        """The rows as numpy arrays, padding rows dropped (rows still running included)."""
        host = to_host(
            {
                f.name: getattr(state, f.name)
                for f in dataclasses.fields(state)
                if f.name not in ("cache", "keys")
            }
        )
        real = host["real"]
        return state_rollouts({k: (v[real] if np.ndim(v) else v) for k, v in host.items()})

    def generate(
        self,
        params: Params | Transformer,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int | None = None,
        key: jax.Array | None = None,
        seed: int = 0,
        version: int = 0,
        row_ids: Sequence[int] | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
        prompt_len: int = 0,
    ) -> Rollouts:
        """start + decode to completion (in `cfg.decode_chunk` chunks if set) + result."""
        params = self._as_params(params)
        state = self.start(
            params,
            prompt_ids,
            n=n,
            key=key,
            seed=seed,
            row_ids=row_ids,
            max_new_tokens=max_new_tokens,
            prompt_len=prompt_len,
        )
        chunk = self.cfg.decode_chunk or None
        state = self.decode(params, state, max_steps=chunk, version=version)
        while chunk and not self.done(state):
            state = self.decode(params, state, max_steps=chunk, version=version)
        return self.result(state)
