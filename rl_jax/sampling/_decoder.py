"""The engine's decoder: the stop and interruption rules, the decode ops and layouts
of the mesh, and one decode step (model, draw, row update) inside a compiled loop;
prompts packed into rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rl_jax import kernels
from rl_jax.config.sampling import SamplingConfig
from rl_jax.kernels.xla import Decode, PagedKV, PagedLayout, Pages
from rl_jax.knobs import ConfigError
from rl_jax.models.decode import decode_step
from rl_jax.models.moe import expert_parallel_moe_mlp
from rl_jax.models.spec import ModelSpec
from rl_jax.models.transformer import Transformer, model_params, param_shardings
from rl_jax.sampling._dist import sample_with_uniforms
from rl_jax.sampling._rollouts import Rollouts
from rl_jax.sampling._state import SamplerState, advance
from rl_jax.sharding.rules import (
    Rules,
    batch_sharding,
    fit_spec,
    get_rules,
    logical_to_spec,
    num_batch_shards,
)

Params = Mapping[str, jax.Array]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


class Decoder:
    """The decoding half of `Engine` (its slots and host loop are the engine's).

    model: the `ModelSpec` (or a `Transformer`, whose spec is used).
    eos_id: stop token(s) used when `cfg.stop_token_ids` is empty.
    interrupt_ids: the tokenized `cfg.interrupt_text` (needed in interrupt mode).
    rules: a sampling rule preset of `rl_jax.sharding.SAMPLE_RULES` or a rule table.
    """

    # Whether the decode step may run its attention / its projections in the
    # platform's own kernels where they apply (`decode_ops`); False keeps XLA's, for
    # comparisons. Read when the compiled functions are first traced.
    platform_attention = True
    platform_matmul = True
    # Record each token's experts (a mixture of experts; routing replay): the engine's.
    record_routes = False

    def __init__(
        self,
        model: ModelSpec | Transformer,
        cfg: SamplingConfig,
        *,
        mesh: Mesh | None = None,
        eos_id: int | Sequence[int] | None = None,
        pad_id: int = 0,
        interrupt_ids: Sequence[int] | None = None,
        rules: str | Rules = "fsdp_tp",
    ):
        self.spec = model.spec if isinstance(model, Transformer) else model
        self.cfg = cfg
        self.mesh = mesh
        self.rules = get_rules(rules, purpose="sample") if isinstance(rules, str) else rules
        self.pad_id = int(pad_id)
        if cfg.ignore_eos or (not cfg.stop_token_ids and eos_id is None):
            stops = ()
        else:  # the configured stop tokens, else the model's EOS id(s)
            stops = cfg.stop_token_ids or np.ravel(eos_id).tolist()
        self.stop_ids = tuple(int(s) for s in stops)
        self.interrupt = cfg.length_control == "interrupt"
        self.interrupt_ids = tuple(int(i) for i in (interrupt_ids or ()))
        if self.interrupt:
            if not self.interrupt_ids:
                raise ConfigError(
                    "sampling.length_control='interrupt' needs interrupt_ids: pass the "
                    "tokenized sampling.interrupt_text to Engine(..., interrupt_ids=...)"
                )
            need = cfg.interrupt_hi + len(self.interrupt_ids) + cfg.answer_budget
            if need > cfg.max_new_tokens:
                raise ConfigError(
                    f"sampling.max_new_tokens={cfg.max_new_tokens} leaves no room for an "
                    f"interruption at sampling.interrupt_hi={cfg.interrupt_hi} plus "
                    f"{len(self.interrupt_ids)} injected tokens plus "
                    f"sampling.answer_budget={cfg.answer_budget}: set it to at least {need}"
                )
        vocab = self.spec.vocab_size
        for name, ids in (("stop", self.stop_ids), ("interrupt", self.interrupt_ids)):
            bad = [i for i in ids if not 0 <= i < vocab]
            if bad:
                raise ConfigError(f"{name} token ids {bad} are outside the vocabulary [0, {vocab})")
        self.shards = 1 if mesh is None else num_batch_shards(mesh)
        self._local_loops = mesh is not None and self.shards == mesh.devices.size
        self.kernels = kernels.for_mesh(mesh)

    @property
    def decode_ops(self) -> Decode:
        """The decode step's ops and layouts (`rl_jax.kernels`, `Kernels.decode`): the
        platform's own kernels where they apply to this sampler's dtype and mesh, and
        where platform_attention / platform_matmul allow; XLA's elsewhere."""
        one_device = self.mesh is None or self.mesh.devices.size == 1
        return self.kernels.decode_ops(
            compute_dtype=self.spec.compute_dtype,
            head_dim=self.spec.head_dim,
            local=one_device or self._local_loops,
            # With a device per core, each device's kernels keep to its own thread.
            threads=one_device,
            attention=self.platform_attention,
            matmul=self.platform_matmul,
        )

    # ---- layouts --------------------------------------------------------------------------

    def param_shardings(self) -> dict[str, jax.sharding.Sharding]:
        """The sampling layout of the parameters (rule table `self.rules`)."""
        return param_shardings(self.spec, self.mesh, self.rules)

    def reshard(self, params: Params | Transformer) -> dict[str, jax.Array]:
        """Parameters moved into the sampling layout (e.g. from the trainer's FSDP layout)."""
        return jax.device_put(self._as_params(params), self.param_shardings())

    @staticmethod
    def _as_params(params: Params | Transformer) -> dict[str, jax.Array]:
        if isinstance(params, Transformer):
            return model_params(params)
        return dict(params)

    def _rows(self, x: jax.Array) -> jax.Array:
        """Pin an array's leading (row) axis to the mesh's batch axes."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, batch_sharding(self.mesh, x.ndim))

    def _constrain(self, x: jax.Array, logical: tuple[str | None, ...]) -> jax.Array:
        """Pin an activation or cache layout by logical axes (no-op without a mesh)."""
        if self.mesh is None:
            return x
        spec = fit_spec(logical_to_spec(logical, self.rules), x.shape, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def _cache_layout(self, cache: PagedKV) -> PagedKV:
        pairs = zip(cache, self.decode_ops.paged_axes(cache), strict=True)
        return PagedKV(*(None if x is None else self._constrain(x, a) for x, a in pairs))

    def _paged_layout(self) -> PagedLayout | None:
        """How a paged cache's attention runs per device on the mesh (None without one):
        rows and their pages over the batch axes, kv heads where the rules put them."""
        if self.mesh is None or self.mesh.devices.size == 1:
            return None
        K = self.spec.num_kv_heads
        heads = fit_spec(logical_to_spec(("kv_heads",), self.rules), (K,), self.mesh)
        return PagedLayout(self.mesh, batch_sharding(self.mesh, 1).spec[0], tuple(heads)[0])

    def _local_cache_specs(self, cache: PagedKV) -> PagedKV:
        """PartitionSpecs of the paged cache under a shard_map over the rows alone: its
        "batch" axis (the rows' pages) over the batch axes."""
        rows = self._row_spec(1)[0]

        def spec(axes):
            return PartitionSpec(*(rows if a == "batch" else None for a in axes))

        return PagedKV(*(None if a is None else spec(a) for a in self.decode_ops.paged_axes(cache)))

    def _row_spec(self, ndim: int) -> PartitionSpec:
        """Rows over the batch axes; scalars (ndim 0) replicated."""
        return batch_sharding(self.mesh, ndim).spec if ndim else PartitionSpec()

    def _put_rows(self, *arrays: np.ndarray) -> list[jax.Array | np.ndarray]:
        """Row arrays laid out over the mesh's batch axes (without a mesh, as they are:
        a jitted call moves numpy arguments itself, faster than a dispatch each)."""
        if self.mesh is None:
            return list(arrays)
        return [jax.device_put(a, batch_sharding(self.mesh, a.ndim)) for a in arrays]

    # ---- the compiled loop's pieces -------------------------------------------------------

    def _over_rows(self, loop: Callable, weights, state: SamplerState, *scalars):
        """loop(weights, state, *scalars, manual=...) -> (state, a tree of row arrays, a
        scalar): on the whole mesh, or, where rows alone split over devices, on every
        device's own rows (shard_map), with no collective per token: each device stops
        when its rows are done. Scalars in and out are replicated (`loop` makes them
        agree)."""
        if not self._local_loops:
            return loop(weights, state, *scalars, manual=False)
        specs = jax.tree.map(lambda x: self._row_spec(x.ndim), state)
        specs = dataclasses.replace(specs, cache=self._local_cache_specs(state.cache))
        rep = self._row_spec(0)
        mapped = jax.shard_map(
            functools.partial(loop, manual=True),
            mesh=self.mesh,
            in_specs=(rep, specs, *(rep for _ in scalars)),
            out_specs=(specs, self._row_spec(1), rep),
            check_vma=False,
        )
        return mapped(weights, state, *scalars)

    def _expert_parallel(self, h, weights, **kw):
        return expert_parallel_moe_mlp(self.mesh, self.rules, h, weights, **kw)

    def _token_step(self, ops: Decode, weights, s: SamplerState, slot, u_b, version, *, manual):
        """One decode step of every row: feed `s.last_token` at its column `slot` [B] (its
        position slot - kv_start in its pages), draw from the logits with the uniforms
        u_b [B] (None for greedy), and write the draw into the row state (`advance`).
        Also each row's experts in every layer [B, L, k] (`record_routes`; else None)."""
        cfg = self.cfg
        rows = (lambda x: x) if manual else self._rows
        constrain = (lambda x, logical: x) if manual else self._constrain
        # A row that ended writes nothing.
        pages = Pages(s.pages, ~s.done, None if manual else self._paged_layout())
        logits_bv, cache, *routes = decode_step(
            self.spec,
            weights,
            s.cache,
            s.last_token,
            slot - s.kv_start,
            pages,
            ops=ops,
            constrain=constrain,
            record_routes=self.record_routes,
            # On a mesh (not one device's rows), the experts stay where they are stored.
            sparse_mlp=None if manual or self.mesh is None else self._expert_parallel,
        )
        tok, logp = sample_with_uniforms(
            logits_bv, u_b, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k
        )
        s = dataclasses.replace(s, cache=cache)
        s = advance(
            s,
            rows(tok),
            rows(logp),
            version=version,
            stop_ids=self.stop_ids,
            interrupt_ids=self.interrupt_ids,
            answer_budget=cfg.answer_budget,
            interrupt=self.interrupt,
            pad_id=self.pad_id,
        )
        return s, (routes[0] if routes else None)


def to_host(tree):
    """numpy copies of (possibly multi-process) arrays: every process gets all rows."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.tree.map(np.asarray, jax.device_get(tree))  # every copy started at once
    return jax.tree.map(get, tree)


def state_rollouts(r: Mapping[str, np.ndarray]) -> Rollouts:
    """Rollouts of host copies of SamplerState row fields (`r[name]`, rows first)."""
    Tg, Tp = r["tokens"].shape[1], r["prompt_tokens"].shape[1]
    within = np.arange(Tg)[None, :] < r["lengths"][:, None]
    return Rollouts(
        prompt_tokens=r["prompt_tokens"],
        prompt_mask=np.arange(Tp)[None, :] >= r["kv_start"][:, None],
        completion_tokens=r["tokens"],
        completion_mask=within & ~r["injected"],
        injected_mask=r["injected"],
        logprobs=r["logprobs"],
        versions=r["versions"],
        lengths=r["lengths"],
        finish_reason=r["finish"],
        truncated=r["truncated"],
        group_ids=r["group_ids"],
        row_ids=r["row_ids"],
        routes=r.get("routes"),
    )
