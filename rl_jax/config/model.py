"""Model configuration (architecture, precision, checkpoint source).

Resolution order (see `rl_jax.models.resolve_spec`): `path` (an HF directory or a
GGUF file) if set, else `preset`; then every nonzero / non-empty field below
overrides the value it names. Precision and execution switches always come
from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import ConfigError, check_choice, check_numbers, check_range, knob

ARCHITECTURES = ("llama", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")
TIE_CHOICES = ("auto", "true", "false")
NORM_TOPK_CHOICES = ("auto", "true", "false")
ATTENTION_CHOICES = ("auto", "dense", "blockwise")
REMAT_CHOICES = ("none", "full", "save_dots")
# Booleans of configs written before remat had policies.
_REMAT_BOOLS = {"false": "none", "true": "full"}


def remat_policy(value) -> str:
    """`model.remat` as a policy name: a bool (true = full, false = none) or a name."""
    name = str(value).lower()
    return _REMAT_BOOLS.get(name, name)


def _scan_layers(value) -> bool | str:
    """`model.scan_layers` as true, false or "auto" (a bool stays a bool, as run ids hash it)."""
    if isinstance(value, bool):
        return value
    name = str(value).lower()
    if name not in ("auto", "true", "false"):
        raise ConfigError(f"model.scan_layers={value!r}: must be true, false or auto")
    return {"true": True, "false": False}.get(name, name)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    preset: str = knob(
        "tiny", help="named architecture preset (tiny, bench, ...); '' = fields only"
    )
    path: str = knob(
        "",
        help="HF directory, GGUF file or rl_jax model directory to load, local or a URL "
        "(gs://BUCKET/models/NAME: copied once into a local cache); wins over preset",
    )
    architecture: str = knob(
        "", help=f"decoder family, one of {ARCHITECTURES} ('' = from preset/checkpoint)"
    )
    vocab_size: int = knob(0, help="vocabulary size V (0 = from preset/checkpoint)")
    hidden_size: int = knob(0, help="model width D (0 = from preset/checkpoint)")
    intermediate_size: int = knob(0, help="MLP width F (0 = from preset/checkpoint)")
    num_layers: int = knob(0, help="layers L (0 = from preset/checkpoint)")
    num_heads: int = knob(0, help="query heads H (0 = from preset/checkpoint)")
    num_kv_heads: int = knob(0, help="key/value heads K (0 = from preset/checkpoint)")
    head_dim: int = knob(0, help="per-head width (0 = from preset/checkpoint, else D / H)")
    rope_theta: float = knob(0.0, help="RoPE base (0 = from preset/checkpoint)")
    max_position: int = knob(0, help="maximum context length (0 = from preset/checkpoint)")
    rms_norm_eps: float = knob(0.0, help="RMSNorm epsilon (0 = from preset/checkpoint)")
    tie_embeddings: str = knob(
        "auto", help=f"share input embedding and LM head, one of {TIE_CHOICES}"
    )
    num_experts: int = knob(
        0,
        help="experts E of a sparse MLP (mixture of experts; 0 = from "
        "preset/checkpoint, where 0 is a dense MLP): docs/moe.md",
    )
    num_experts_per_tok: int = knob(
        0, help="experts k each token is routed to (top-k; 0 = from preset/checkpoint)"
    )
    moe_intermediate_size: int = knob(
        0, help="each expert's MLP width (0 = from preset/checkpoint)"
    )
    shared_expert_intermediate_size: int = knob(
        0,
        help="the width of a shared expert every token goes through beside its k, gated by "
        "a sigmoid (Qwen2-MoE); 0 = from preset/checkpoint, where 0 is none",
    )
    norm_topk_prob: str = knob(
        "auto",
        help=f"renormalize the k chosen experts' router probabilities to sum to 1 (Qwen3-MoE), "
        f"one of {NORM_TOPK_CHOICES} (auto = from preset/checkpoint)",
    )
    routing_replay: bool = knob(
        False,
        help="the trainer routes each token to the experts the sampler chose for it "
        "(recorded in prefill and decode), so the importance ratio measures only the "
        "weights' change, not routing flips; mixture of experts only: docs/moe.md",
    )
    param_dtype: str = knob("float32", help=f"parameter dtype, one of {DTYPES}")
    compute_dtype: str = knob("float32", help=f"activation/matmul dtype, one of {DTYPES}")
    fp32_lm_head: bool = knob(False, help="final norm and LM head in float32 (ScaleRL)")
    exact_rounding: bool = knob(
        False,
        help="the sampler's and the trainer's programs round every op to the compute "
        "dtype as written (XLA's excess precision off), so their log-probs of a token "
        "differ far less in bfloat16: docs/precision.md",
    )
    remat: str = knob(
        "none",
        help=f"what the backward pass recomputes of each layer, one of {REMAT_CHOICES}: "
        "none (keep every activation), full (keep only the layer's input), save_dots "
        "(keep the weight matmuls' outputs); true/false mean full/none",
    )
    attention: str = knob(
        "auto",
        help=f"training attention, one of {ATTENTION_CHOICES}: dense ([B, H, T, S] scores), "
        "blockwise (online softmax over key blocks: memory O(T x attention_block)), "
        "auto (blockwise when a forward has more than 1024 keys)",
    )
    attention_block: int = knob(512, help="key slots per block of blockwise attention")
    scan_layers: str | bool = knob(
        "auto",
        help="the forward's layers as one rolled loop (true: lax.scan, compile time "
        "independent of depth; the backward's residuals go through stacked buffers) or "
        "unrolled in the program (false: a faster step, compile time grows with depth); "
        "auto: rolled from 8 layers up",
    )
    value_head: bool | None = knob(
        None,
        help="add a scalar value head (PPO critic); null = when the advantage estimator is "
        "'gae' (loss.advantage, or the loss's own)",
    )
    logprob_chunk: int = knob(
        -1,
        help="time steps per chunk of the LM head's float32 logits in log-probs/entropy "
        "(0 = all at once; -1 = auto: chunks of 2**24 / V steps, 64 MB per row, once a "
        "row's logits exceed that)",
    )

    def __post_init__(self):
        check_numbers("model", self)
        # `model.tie_embeddings=false` arrives from YAML-typed overrides as the string
        # 'False': accept any capitalization.
        object.__setattr__(self, "tie_embeddings", str(self.tie_embeddings).lower())
        check_choice("model", "tie_embeddings", self.tie_embeddings, TIE_CHOICES)
        object.__setattr__(self, "norm_topk_prob", str(self.norm_topk_prob).lower())
        check_choice("model", "norm_topk_prob", self.norm_topk_prob, NORM_TOPK_CHOICES)
        object.__setattr__(self, "remat", remat_policy(self.remat))
        object.__setattr__(self, "scan_layers", _scan_layers(self.scan_layers))
        check_model(self, resolved=False)


# The sizes of a decoder: 0 in a ModelConfig means "from the preset or the checkpoint".
DIMENSIONS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position",
)
EXPERTS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


def check_model(m, *, resolved: bool) -> None:
    """The one validation of a model's description, for a `ModelConfig` (resolved=False:
    0 or '' mean "from the preset or the checkpoint") and for the `ModelSpec` resolved from
    it (resolved=True: every dimension set). A check between two fields runs as soon as
    both are set, so a config that no preset can fix is refused before any loading."""
    check_choice(
        "model", "architecture", m.architecture, ARCHITECTURES + (() if resolved else ("",))
    )
    check_choice("model", "param_dtype", m.param_dtype, DTYPES)
    check_choice("model", "compute_dtype", m.compute_dtype, DTYPES)
    check_choice("model", "remat", m.remat, REMAT_CHOICES)
    check_choice("model", "attention", m.attention, ATTENTION_CHOICES)
    check_range("model", "attention_block", m.attention_block, lo=1, hi=2**31 - 1)
    for name in DIMENSIONS + EXPERTS:
        value = getattr(m, name)
        if resolved and name in DIMENSIONS and value <= 0:
            raise ConfigError(f"model.{name}={value} must be > 0")
        # 0 = from the preset/checkpoint; above int32 no array dimension is meant.
        check_range("model", name, value, lo=0, hi=2**31 - 1)
    check_range("model", "logprob_chunk", m.logprob_chunk, lo=-1, hi=2**31 - 1)
    for name in ("rope_theta", "rms_norm_eps"):
        if getattr(m, name) < 0 or (resolved and name == "rope_theta" and m.rope_theta == 0):
            raise ConfigError(
                f"model.{name}={getattr(m, name)} must be "
                + ("> 0" if resolved else ">= 0 (0 = default)")
            )
    if m.num_heads and m.num_kv_heads and m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of "
            f"model.num_kv_heads={m.num_kv_heads} (grouped-query attention)"
        )
    if m.head_dim % 2:
        raise ConfigError(f"model.head_dim={m.head_dim} must be even (RoPE pairs)")
    _check_experts(m, resolved=resolved)


def _check_experts(m, *, resolved: bool) -> None:
    E, k, Fe = m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size
    if (E and k > E) or (resolved and E and not k):
        raise ConfigError(
            f"model.num_experts_per_tok={k} must be in [1, model.num_experts={E}] "
            "(a mixture-of-experts model routes each token to k experts)"
        )
    if resolved and E and Fe <= 0:
        raise ConfigError(
            f"model.moe_intermediate_size={Fe} must be > 0 with model.num_experts={E} "
            "(each expert's MLP width)"
        )
    Fs = m.shared_expert_intermediate_size
    if resolved and Fs and not E:
        raise ConfigError(
            f"model.shared_expert_intermediate_size={Fs} needs experts (model.num_experts > 0): "
            "a shared expert sits beside a mixture of experts' routed ones"
        )
    dense = list(getattr(m, "dense_layers", ()))  # a ModelSpec's (from a checkpoint)
    L = m.num_layers
    ints = all(isinstance(i, int) and not isinstance(i, bool) for i in dense)
    if dense and (
        not ints or not E or dense != sorted(set(dense)) or not 0 <= dense[0] <= dense[-1] < L
    ):
        raise ConfigError(
            f"model dense_layers={dense} must be ascending layer indices in [0, {L}) of a "
            "mixture of experts (model.num_experts > 0)"
        )
    if dense and len(dense) == L:
        raise ConfigError(
            f"model dense_layers={dense} leave no sparse layer: a dense model has "
            "model.num_experts=0"
        )
