"""ModelSpec: every dimension of a decoder resolved; presets; FLOPs per token.

A `ModelConfig` is what a user writes (zeros mean "from the preset or the
checkpoint"); a `ModelSpec` is what the model code reads: nothing left to
resolve, hashable, so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rl_jax.config.model import (
    ARCHITECTURES,
    DIMENSIONS,
    EXPERTS,
    ModelConfig,
    check_model,
    remat_policy,
)
from rl_jax.knobs import ConfigError


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 frequency scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    def __post_init__(self):
        """Values the frequencies can be computed from (`layers.rope_inv_freq` divides by
        factor, each freq factor, and their difference): else a ConfigError naming it."""
        low = self.low_freq_factor
        for name, value, lo in (
            ("factor", self.factor, 0),
            ("low_freq_factor", low, 0),
            ("high_freq_factor", self.high_freq_factor, low),
            ("original_max_position", self.original_max_position, 0),
        ):
            if not value > lo:
                bound = "low_freq_factor" if name == "high_freq_factor" else "0"
                raise ConfigError(f"rope_scaling {name}={value!r} must be > {bound}")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    architecture: str
    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    max_position: int = 2048
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (always), Llama/Qwen3 with attention_bias
    o_bias: bool = False  # Llama/Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3
    # Mixture of experts (0 experts: a dense MLP of width F). A layer's MLP is sparse: E
    # SwiGLU experts of width moe_intermediate_size, each token through the top k of a
    # softmax router; but the layers in `dense_layers` have a dense MLP of width F (Qwen3-
    # MoE's mlp_only_layers and decoder_sparse_step; every published Qwen3-MoE has none).
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k
    moe_intermediate_size: int = 0  # Fe
    norm_topk_prob: bool = False  # the k chosen probabilities renormalized to sum to 1
    # A shared expert of this width beside the routed ones (Qwen2-MoE): every token goes
    # through it, its output scaled by a sigmoid gate [D, 1]. 0: none.
    shared_expert_intermediate_size: int = 0  # Fs
    dense_layers: tuple[int, ...] = ()  # of a mixture of experts, ascending
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    fp32_lm_head: bool = False
    exact_rounding: bool = False  # the programs' XLA excess precision off (`xla_options`)
    remat: str = "none"
    attention: str = "auto"
    attention_block: int = 512
    scan_layers: bool = False  # the layers as one rolled loop (`transformer.over_layers`)
    value_head: bool = False
    logprob_chunk: int = -1
    # Special tokens as the checkpoint declares them (-1 / () = none); export
    # writes them back so transformers' generate stops where the model expects.
    bos_token_id: int = -1
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = -1

    def __post_init__(self):
        object.__setattr__(self, "remat", remat_policy(self.remat))
        check_model(self, resolved=True)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mixed(self) -> bool:
        """A mixture of experts with some dense layers: a layer's MLP is picked by its
        index (`rl_jax.models.transformer.mixed_mlp`)."""
        return self.is_moe and bool(self.dense_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none of a dense model)."""
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.num_layers) if self.is_moe and i not in dense)

    @property
    def active_mlp_width(self) -> float:
        """The MLP width a token goes through, averaged over the layers: F, or k
        experts' k x Fe (and a shared expert's Fs)."""
        if self.is_moe:
            k, Fe = self.num_experts_per_tok, self.moe_intermediate_size
            sparse = k * Fe + self.shared_expert_intermediate_size
            Ls = len(self.sparse_layers)
            return (Ls * sparse + (self.num_layers - Ls) * self.intermediate_size) / self.num_layers
        return self.intermediate_size

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    # ---- size and compute accounting -------------------------------------------------

    def layer_matmul_params(self, layer: int = 0) -> int:
        """Weights one token multiplies through in layer `layer` (attention + MLP)."""
        return self._matmul_params(layer in self.sparse_layers)

    def matmul_params(self) -> int:
        """Weights one token multiplies through in all layers."""
        sparse = len(self.sparse_layers)
        dense = self.num_layers - sparse
        return sparse * self._matmul_params(True) + dense * self._matmul_params(False)

    def _matmul_params(self, sparse: bool) -> int:
        D, F, H, K, hd = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        attention = D * H * hd + 2 * D * K * hd + H * hd * D
        if sparse:  # the router, the k experts a token goes through, the shared one
            E, k, Fe = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size
            Fs = self.shared_expert_intermediate_size
            return attention + D * E + k * 3 * D * Fe + (3 * D * Fs + D if Fs else 0)
        return attention + 3 * D * F

    def num_params(self) -> int:
        """All parameters, embeddings and norms included (every expert's)."""
        D, V, L, hd = self.hidden_size, self.vocab_size, self.num_layers, self.head_dim
        H, K = self.num_heads, self.num_kv_heads
        per_layer = 2 * D
        if self.qkv_bias:
            per_layer += (H + 2 * K) * hd
        if self.o_bias:
            per_layer += D
        if self.qk_norm:
            per_layer += 2 * hd
        n = self.matmul_params() + L * per_layer + V * D + D
        if self.is_moe:  # all E experts are parameters; a token multiplies through k
            E, k, Fe = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size
            n += len(self.sparse_layers) * (E - k) * 3 * D * Fe
        if not self.tie_embeddings:
            n += V * D
        if self.value_head:
            n += D + 1
        return n

    def flops_per_token(self, context_len: float) -> float:
        """Forward FLOPs of one token that attends to `context_len` keys (itself included).

        2 FLOPs per multiply-add through every weight matrix it multiplies through (the
        embedding lookup is free, the LM head is not; of a mixture of experts, the router
        and the k experts it is routed to: active parameters) plus 4 * H * hd per attended key and
        layer (scores q.k and the weighted sum of v). Norms, RoPE and softmax are
        left out, as in the usual 6N-style accounting.
        """
        dense = 2 * (self.matmul_params() + self.vocab_size * self.hidden_size)
        if self.value_head:
            dense += 2 * self.hidden_size
        attn = 4 * self.num_layers * self.num_heads * self.head_dim * context_len
        return float(dense + attn)

    def train_flops_per_token(self, context_len: float) -> float:
        """Forward + backward (backward = 2x forward). Rematerialization is not counted:
        these are model FLOPs, the same whatever the memory strategy."""
        return 3.0 * self.flops_per_token(context_len)

    def sequence_flops(self, seq_len: int, *, train: bool = False) -> float:
        """Forward (or forward+backward) FLOPs of one causal sequence of `seq_len` tokens:
        token t attends to t + 1 keys, so the attention term sums to T (T + 1) / 2."""
        T = seq_len
        total = T * self.flops_per_token(0) + 4 * self.num_layers * self.num_heads * (
            self.head_dim * T * (T + 1) / 2
        )
        return 3.0 * total if train else total


# ---- presets -------------------------------------------------------------------------

# Architecture-level fields only; precision and execution switches come from the
# ModelConfig. One row a preset: (name, architecture, V, D, F, L, H, K, rope theta, max
# position, RMSNorm eps, tied embeddings), then what it sets beside them: `head_dim`
# only where it is not D / H; a mixture of experts' fields (`intermediate_size` then is
# the family's dense width, unused); Llama 3's rotary scaling.
_QWEN3 = dict(head_dim=128)
_QWEN3_MOE = dict(head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)


def _llama3(factor: float) -> dict[str, Any]:  # Llama 3.1 / 3.2's rotary scaling
    return dict(
        rope_scaling=RopeScaling(
            factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192
        )
    )


def _qwen2_moe(E: int, k: int, Fe: int, Fs: int) -> dict[str, Any]:
    # Qwen2-MoE: a shared expert beside the top k of E, the k probabilities as they are.
    return dict(
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=Fe,
        shared_expert_intermediate_size=Fs,
        norm_topk_prob=False,
    )


_PRESET_FIELDS = (
    "architecture",
    *DIMENSIONS[:6],  # vocab_size .. num_kv_heads
    "rope_theta",
    "max_position",
    "rms_norm_eps",
    "tie_embeddings",
)
# fmt: off
_PRESET_ROWS = (
    # CPU demo: a character-level arithmetic model that learns in minutes on 2 cores.
    ("tiny", "qwen2", 64, 128, 384, 4, 4, 2, 1e4, 512, 1e-6, True, {}),
    ("bench", "qwen2", 512, 256, 688, 4, 4, 2, 1e4, 2048, 1e-6, False, {}),  # the benchmarks'
    ("smollm2-135m", "llama", 49152, 576, 1536, 30, 9, 3, 1e5, 8192, 1e-5, True, {}),
    ("qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 1e6, 32768, 1e-6, True, {}),
    ("qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 1e6, 40960, 1e-6, True, _QWEN3),
    # Qwen2.5-*-Instruct's config.json (the base model's allows 131072)
    ("qwen2.5-1.5b", "qwen2", 151936, 1536, 8960, 28, 12, 2, 1e6, 32768, 1e-6, True, {}),
    ("qwen2.5-7b", "qwen2", 152064, 3584, 18944, 28, 28, 4, 1e6, 32768, 1e-6, False, {}),
    ("qwen3-1.7b", "qwen3", 151936, 2048, 6144, 28, 16, 8, 1e6, 40960, 1e-6, True, _QWEN3),
    ("qwen3-4b", "qwen3", 151936, 2560, 9728, 36, 32, 8, 1e6, 40960, 1e-6, True, _QWEN3),
    ("qwen3-8b", "qwen3", 151936, 4096, 12288, 36, 32, 8, 1e6, 40960, 1e-6, False, _QWEN3),
    ("qwen3-14b", "qwen3", 151936, 5120, 17408, 40, 40, 8, 1e6, 40960, 1e-6, False, _QWEN3),
    ("qwen3-32b", "qwen3", 151936, 5120, 25600, 64, 64, 8, 1e6, 40960, 1e-6, False, _QWEN3),
    # Qwen3-MoE: every layer sparse, 128 experts, top 8, the chosen probabilities renormalized.
    ("qwen3-30b-a3b", "qwen3", 151936, 2048, 6144, 48, 32, 4, 1e6, 40960, 1e-6, False,
     dict(_QWEN3_MOE, moe_intermediate_size=768)),
    ("qwen3-235b-a22b", "qwen3", 151936, 4096, 12288, 94, 64, 4, 1e6, 40960, 1e-6, False,
     dict(_QWEN3_MOE, moe_intermediate_size=1536)),
    ("qwen1.5-moe-a2.7b", "qwen2", 151936, 2048, 5632, 24, 16, 16, 1e6, 8192, 1e-6, False,
     _qwen2_moe(60, 4, 1408, 5632)),
    ("qwen2-57b-a14b", "qwen2", 151936, 3584, 18944, 28, 28, 4, 1e6, 32768, 1e-6, False,
     _qwen2_moe(64, 8, 2560, 20480)),
    # The CPU demo model with a sparse MLP: 4 experts of width F / 2, each token through 2
    # (as many MLP FLOPs per token as tiny's), Qwen3-MoE's layout so it exports.
    ("tiny-moe", "qwen3", 64, 128, 384, 4, 4, 2, 1e4, 512, 1e-6, True,
     dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192, norm_topk_prob=True)),
    ("llama3.2-3b", "llama", 128256, 3072, 8192, 28, 24, 8, 5e5, 131072, 1e-5, True, _llama3(32.0)),
    ("llama3.1-8b", "llama", 128256, 4096, 14336, 32, 32, 8, 5e5, 131072, 1e-5, False,
     _llama3(8.0)),
    ("llama3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 5e5, 131072, 1e-5, True, _llama3(32.0)),
)
# fmt: on
PRESETS: dict[str, dict[str, Any]] = {
    row[0]: dict(zip(_PRESET_FIELDS, row[1:-1], strict=True), **row[-1]) for row in _PRESET_ROWS
}


def get_preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"model.preset={name!r} is not one of {sorted(PRESETS)}")
    return dict(PRESETS[name])


def arch_flags(architecture: str, attention_bias: bool = False) -> dict[str, bool]:
    """Bias / norm layout implied by the family (mirrors transformers' modeling code)."""
    if architecture == "qwen2":
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)
    if architecture == "qwen3":
        return dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    if architecture == "llama":
        return dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False)
    raise ConfigError(f"model.architecture={architecture!r} is not one of {list(ARCHITECTURES)}")


# What a ModelConfig's nonzero fields override in the preset's or checkpoint's fields.
_OVERRIDABLE = (*DIMENSIONS, "rope_theta", "rms_norm_eps", *EXPERTS)
# What a spec cannot be built without (head_dim defaults to D / H, max_position to 2048).
_REQUIRED = (
    "architecture",
    *(d for d in DIMENSIONS if d not in ("head_dim", "max_position")),
    "rope_theta",
)


# model.scan_layers=auto rolls the layer loop from this depth up: an unrolled program's
# compile grows with depth (on libtpu even more than on CPU), a rolled one costs each
# step (zero-filled stacked residuals, written and read back). What each costs, measured:
# docs/results/performance.md, "The RL step from dda6763".
SCAN_FROM_LAYERS = 8


def scan_layers(knob: bool | str, num_layers: int) -> bool:
    """`model.scan_layers` (true, false, or "auto": from the depth) for `num_layers` layers."""
    return num_layers >= SCAN_FROM_LAYERS if knob == "auto" else bool(knob)


def spec_from_fields(cfg: ModelConfig, fields: dict[str, Any], source: str) -> ModelSpec:
    """Every dimension resolved: the base `fields` (from `source`: a checkpoint, a preset),
    then `cfg`'s explicit fields override (rl_jax.models.load.resolve_spec picks the base)."""
    fields = dict(fields)
    explicit_head_dim = "head_dim" in fields
    for name in _OVERRIDABLE:
        value = getattr(cfg, name)
        if value:
            fields[name] = value
            explicit_head_dim |= name == "head_dim"
    if cfg.architecture:
        fields["architecture"] = cfg.architecture
    missing = [n for n in _REQUIRED if not fields.get(n)]
    if missing:
        raise ConfigError(
            f"model spec from {source} lacks {missing}: set model.{missing[0]}=... "
            f"or pick a model.preset from {sorted(PRESETS)}"
        )
    if not explicit_head_dim:
        D, H = fields["hidden_size"], fields["num_heads"]
        if D % H:
            raise ConfigError(
                f"model.hidden_size={D} is not divisible by model.num_heads={H}; set model.head_dim"
            )
        fields["head_dim"] = D // H
    if cfg.tie_embeddings != "auto":
        fields["tie_embeddings"] = cfg.tie_embeddings == "true"
    if cfg.norm_topk_prob != "auto":
        fields["norm_topk_prob"] = cfg.norm_topk_prob == "true"
    attention_bias = fields.pop("attention_bias", False)
    flags = arch_flags(fields["architecture"], attention_bias)
    for k, v in flags.items():
        fields.setdefault(k, v)
    return ModelSpec(
        **fields,
        param_dtype=cfg.param_dtype,
        compute_dtype=cfg.compute_dtype,
        fp32_lm_head=cfg.fp32_lm_head,
        exact_rounding=cfg.exact_rounding,
        remat=cfg.remat,
        attention=cfg.attention,
        attention_block=cfg.attention_block,
        scan_layers=scan_layers(cfg.scan_layers, fields["num_layers"]),
        value_head=bool(cfg.value_head),  # null: rl_jax.config.resolved fills it from the loss
        logprob_chunk=cfg.logprob_chunk,
    )
