"""What the trainer holds and updates, and the weights the model computes with.

The trainer's state (`params`, checkpointed as it is) is a dict by `param_layout`
name, plus, with LoRA, `"lora": {target: {"a": [L, d_in, r], "b": [L, r, d_out]}}`
(the LM head's adapters have no L). `ParamFormat.view` turns it into the model's
weights: every weight in `model.param_dtype`, adapters merged as
W + (alpha / r) A B. The train step differentiates the loss through the view, so
the sampler, the log-prob passes and the loss all see one function of the state.

Precision (train.precision) and LoRA decide the dtypes of the state:

| part | fp32_master | fp32_moments | pure |
|---|---|---|---|
| trained weights (all, or adapters + value head) | float32 | param_dtype | param_dtype |
| optimizer moments | float32 | float32 | param_dtype |
| frozen base (LoRA) | param_dtype | param_dtype | param_dtype |

A bfloat16 weight has 8 significant bits: an Adam step of lr 1e-6 on a weight of
0.02 is ~2^-14 of it, far below half its last bit, so rounding it into the weight
loses it; float32 masters keep it (pure bf16: 0.39% of the weights changed in two
updates).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from rl_jax.config import RunConfig
from rl_jax.config.lora import LORA_TARGETS
from rl_jax.knobs import ConfigError
from rl_jax.models import ModelSpec, param_layout
from rl_jax.models.layers import matmul
from rl_jax.models.transformer import LAYER_PARAMS
from rl_jax.sharding import replicated

LORA_KEY = "lora"
# Trained beside the adapters: the critic's head starts at zero and has nothing to adapt.
LORA_ALSO_TRAINED = ("value_w", "value_b")

State = dict[str, Any]


def lora_dims(target: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, d_in, d_out) of the adapters of `target` (a weight of `shape`):
    A [*lead, d_in, r], B [*lead, r, d_out], A B reshaped to the weight's shape. The
    output projection `o` [L, H, hd, D] reads H x hd; the LM head [V, D] is factored as
    stored."""
    lead = shape[:1] if target in LAYER_PARAMS else ()
    rest = shape[len(lead) :]
    n_in = 2 if target == "o" else 1
    return lead, math.prod(rest[:n_in]), math.prod(rest[n_in:])


def adapter_shapes(target: str, shape: tuple[int, ...], rank: int) -> dict[str, tuple]:
    """{"a": A's shape, "b": B's} of `target`'s rank-`rank` adapters (see lora_dims)."""
    lead, d_in, d_out = lora_dims(target, shape)
    return {"a": (*lead, d_in, rank), "b": (*lead, rank, d_out)}


def replicated_on(mesh: Mesh | None):
    """Every device of `mesh` holds the array whole (no mesh: the first device)."""
    return SingleDeviceSharding(jax.devices()[0]) if mesh is None else replicated(mesh)


def check_lora(spec: ModelSpec, targets: tuple[str, ...], rank: int) -> None:
    """Each target is a weight of this model and the rank is below its dimensions."""
    lay = param_layout(spec)
    for t in targets:
        if t not in lay:
            why = " (the head is tied to the embedding)" if t == "lm_head" else ""
            if spec.is_moe and t in ("gate", "up", "down"):
                why = " (its MLP is a mixture of experts, which takes no adapters yet)"
            have = [n for n in LORA_TARGETS if n in lay]
            raise ConfigError(
                f"lora.targets names {t!r}, which this model has no weight for{why}; it has {have}"
            )
        _, d_in, d_out = lora_dims(t, lay[t].shape)
        if rank > min(d_in, d_out):
            raise ConfigError(
                f"lora.rank={rank} exceeds {t!r}'s smaller side ({d_in} x {d_out}); "
                f"use at most {min(d_in, d_out)}"
            )


@dataclasses.dataclass(frozen=True)
class ParamFormat:
    """How a run's weights are held (see the module doc); pure functions of the state."""

    param_dtype: str = "float32"
    precision: str = "fp32_master"
    lora_rank: int = 0  # 0: no adapters, every weight trains
    lora_scale: float = 1.0
    lora_targets: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: RunConfig, spec: ModelSpec) -> ParamFormat:
        lora = cfg.lora
        if not lora.enabled:
            return cls(param_dtype=spec.param_dtype, precision=cfg.train.precision)
        check_lora(spec, lora.target_names, lora.rank)
        return cls(
            param_dtype=spec.param_dtype,
            precision=cfg.train.precision,
            lora_rank=lora.rank,
            lora_scale=lora.scale,
            lora_targets=lora.target_names,
        )

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def trained_dtype(self):
        return jnp.float32 if self.precision == "fp32_master" else jnp.dtype(self.param_dtype)

    @property
    def moment_dtype(self):
        return jnp.dtype(self.param_dtype) if self.precision == "pure" else jnp.float32

    @property
    def identity(self) -> bool:
        """The view is the state itself (no adapters, trained weights in param_dtype)."""
        return not self.lora and self.trained_dtype == jnp.dtype(self.param_dtype)

    # ---- the state --------------------------------------------------------------------

    def _trained_names(self, names) -> list[str]:
        if not self.lora:
            return list(names)
        return [n for n in names if n == LORA_KEY or n in LORA_ALSO_TRAINED]

    def split(self, state: State) -> tuple[State, State]:
        """(trained, frozen): the weights the optimizer updates, and the rest."""
        trained = set(self._trained_names(state))
        return (
            {k: v for k, v in state.items() if k in trained},
            {k: v for k, v in state.items() if k not in trained},
        )

    @staticmethod
    def join(trained: State, frozen: State) -> State:
        return {**frozen, **trained}

    def init_state(
        self, weights: dict[str, jax.Array], *, key: jax.Array, mesh: Mesh | None
    ) -> State:
        """The trainer's state from model weights (placed): each cast to its role's dtype
        where it lies; with LoRA, adapters A ~ N(0, 1 / d_in) and B = 0 (replicated), so
        the view equals `weights` in param_dtype."""
        trained = set(self._trained_names(weights))
        dtypes = {
            k: self.trained_dtype if k in trained else jnp.dtype(self.param_dtype) for k in weights
        }
        # Only the weights whose dtype changes are copied (a model may be most of memory).
        todo = {k: v for k, v in weights.items() if v.dtype != dtypes[k]}
        cast = jax.jit(
            lambda w: {k: v.astype(dtypes[k]) for k, v in w.items()},
            out_shardings={k: v.sharding for k, v in todo.items()},
        )
        state = {**weights, **(cast(todo) if todo else {})}
        if self.lora:
            spec_shapes = {k: tuple(v.shape) for k, v in weights.items()}
            state[LORA_KEY] = self._init_adapters(spec_shapes, key, mesh)
        return state

    def _init_adapters(self, shapes: dict[str, tuple[int, ...]], key, mesh: Mesh | None):
        dims = {t: lora_dims(t, shapes[t]) for t in self.lora_targets}
        r, dt = self.lora_rank, self.trained_dtype

        def init(key):
            out = {}
            for i, (t, (lead, d_in, d_out)) in enumerate(dims.items()):
                a = jax.random.normal(jax.random.fold_in(key, i), (*lead, d_in, r), jnp.float32)
                out[t] = {
                    "a": (a / math.sqrt(d_in)).astype(dt),
                    "b": jnp.zeros((*lead, r, d_out), dt),
                }
            return out

        # Adapters are small: every device holds them whole.
        return jax.jit(init, out_shardings=replicated_on(mesh))(key)

    def abstract_state(self, spec: ModelSpec, shardings=None, mesh: Mesh | None = None) -> State:
        """The state `init_state` makes for `spec`, as shapes (dtypes by role; the model's
        weights on `shardings` by name, adapters replicated over `mesh`)."""
        lay = param_layout(spec)
        trained = set(self._trained_names([*lay, LORA_KEY]))

        def abstract(shape, dtype, sharding=None):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        out = {
            k: abstract(
                i.shape,
                self.trained_dtype if k in trained else jnp.dtype(self.param_dtype),
                None if shardings is None else shardings[k],
            )
            for k, i in lay.items()
        }
        if self.lora:
            rep = None if mesh is None else replicated(mesh)
            out[LORA_KEY] = {}
            for t in self.lora_targets:
                shapes = adapter_shapes(t, lay[t].shape, self.lora_rank)
                out[LORA_KEY][t] = {
                    p: abstract(s, self.trained_dtype, rep) for p, s in shapes.items()
                }
        return out

    def view(self, state: State) -> dict[str, jax.Array]:
        """The model's weights (param_layout names, param_dtype), adapters merged."""
        if self.identity:
            return state
        dt = jnp.dtype(self.param_dtype)
        adapters = state.get(LORA_KEY, {})
        out = {}
        for k, w in state.items():
            if k == LORA_KEY:
                continue
            if k in adapters:
                w = self._merged(w, adapters[k])
            out[k] = w.astype(dt)
        return out

    def abstract_view(self, state: State) -> dict[str, jax.ShapeDtypeStruct]:
        """`view`'s weights for an abstract `state`: param_dtype, laid out as the state's."""
        dt = jnp.dtype(self.param_dtype)
        return {
            k: jax.ShapeDtypeStruct(a.shape, dt, sharding=a.sharding)
            for k, a in state.items()
            if k != LORA_KEY
        }

    def train_view(self, state: State) -> dict[str, jax.Array]:
        """`view` as the loss differentiates it: the same values, but each trained float32
        weight stays float32 (its value rounded to param_dtype, the gradient passed
        straight through). The model casts every weight to the compute dtype where it
        uses it, so the forward is `view`'s; the backward adds the contributions of a
        weight's uses (prompt and completion streams, tied embedding and LM head) in
        float32. Through a param_dtype view they would be rounded to bfloat16 and added
        there: on the tiny model 0.25% of gradient error and sign flips where they
        cancel, with float32 compute (docs/precision.md)."""
        if self.identity:
            return state
        dt = jnp.dtype(self.param_dtype)
        out = self.view(state)
        trained = set(self._trained_names(state))
        for k, w in state.items():
            if k in trained and k != LORA_KEY and w.dtype == jnp.float32 != dt:
                out[k] = _round_through(w, dt)
        if self.lora:
            # Merged weights: the adapters' gradient through W + s A B, added in float32.
            base = {k: v for k, v in state.items() if k != LORA_KEY}
            for k, adapter in state.get(LORA_KEY, {}).items():
                out[k] = _round_through(self._merged(base[k], adapter), dt)
        return out

    def _merged(self, w: jax.Array, adapter: dict[str, jax.Array]) -> jax.Array:
        """W + s A B in float32: a weight with its adapters merged."""
        f32 = jnp.float32
        delta = matmul(adapter["a"].astype(f32), adapter["b"].astype(f32)).reshape(w.shape)
        return w.astype(f32) + self.lora_scale * delta

    # ---- the optimizer ----------------------------------------------------------------

    def init_optimizer(self, tx: optax.GradientTransformation, state: State):
        """The optimizer state of the trained part, moments in `moment_dtype`."""
        trained, _ = self.split(state)
        return tx.init(_cast(trained, self.moment_dtype))

    def optimizer_shardings(self, tx: optax.GradientTransformation, state: State, mesh: Mesh):
        """Shardings of `init_optimizer(tx, state)` on `mesh`: every parameter-shaped leaf
        (Adam's moments, MultiSteps' accumulated gradients) as its weight, so that FSDP and
        tensor splits shard the optimizer state too; counts and other leaves replicated.
        XLA does not infer this: a moment is zeros, which depend on no input, and jit
        would return them on one device (and replicated, an 8B model's AdamW state whole
        on every chip)."""
        trained, _ = self.split(state)
        shapes = jax.eval_shape(functools.partial(self.init_optimizer, tx), state)
        rep = replicated(mesh)

        def on_mesh(a):  # a weight not laid out on the mesh: its moments replicated
            sh = getattr(a, "sharding", None)
            return sh if isinstance(sh, NamedSharding) and sh.mesh == mesh else rep

        return optax.tree_map_params(
            tx,
            lambda _, sharding: sharding,
            shapes,
            jax.tree.map(on_mesh, trained),
            transform_non_params=lambda _: rep,
        )

    def abstract_optimizer(self, tx: optax.GradientTransformation, state: State, mesh: Mesh):
        """`init_optimizer(tx, state)` as shapes on its `optimizer_shardings` (`state`:
        abstract arrays)."""
        shapes = jax.eval_shape(functools.partial(self.init_optimizer, tx), state)
        return jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            shapes,
            self.optimizer_shardings(tx, state, mesh),
        )

    def apply(self, tx: optax.GradientTransformation, grads: State, opt_state, trained: State):
        """One optimizer update of the trained part: (trained, opt_state). The update is
        computed in `moment_dtype` and added to each weight in that dtype before it is
        stored back in its own."""
        m = self.moment_dtype
        p = _cast(trained, m)
        updates, opt_state = tx.update(_cast(grads, m), opt_state, p)
        new = jax.tree.map(lambda w, pm, u: (pm + u.astype(m)).astype(w.dtype), trained, p, updates)
        return new, opt_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _round_through(w: jax.Array, dtype) -> jax.Array:
    """w rounded to `dtype`, kept in w's dtype; the gradient passes through unrounded."""
    return w.astype(dtype).astype(w.dtype)


def _round_through_fwd(w, dtype):
    return _round_through(w, dtype), None


def _round_through_bwd(dtype, _, g):
    return (g,)


_round_through.defvjp(_round_through_fwd, _round_through_bwd)


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), tree)


def tree_bytes(tree) -> int:
    """Bytes of every array in a pytree (an optimizer state's memory)."""
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
