"""Sampler configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import ConfigError, check_choice, check_numbers, check_range, knob

LENGTH_CONTROL = ("truncate", "interrupt")
# Bounds that catch a typo before it becomes a host allocation of that many rows or tokens.
MAX_SAMPLES = 1 << 16
MAX_TOKENS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    n: int = knob(8, help="samples per prompt (G, IsoCompute's n)")
    temperature: float = knob(
        1.0, help="sampling temperature (0 = greedy); reported log-probs are at this temperature"
    )
    top_p: float = knob(1.0, help="nucleus sampling mass (1 = off)")
    top_k: int = knob(0, help="top-k sampling (0 = off)")
    max_new_tokens: int = knob(32, help="generation budget per row")
    max_prompt_len: int = knob(
        0,
        help="longest prompt in tokens, checked against the data at start (0 = auto: the "
        "longest rendered prompt of the data, rounded up to length_bucket)",
    )
    length_bucket: int = knob(
        16, help="prompt/generation lengths are rounded up to a multiple of this"
    )
    stop_token_ids: list[int] = knob(
        help="tokens that end a row (empty = tokenizer EOS)", factory=list
    )
    ignore_eos: bool = knob(
        False, help="no stop tokens at all: every row decodes max_new_tokens (benchmarks)"
    )
    length_control: str = knob("truncate", help=f"one of {LENGTH_CONTROL}")
    interrupt_lo: int = knob(0, help="forced interruption: lowest length (tokens)")
    interrupt_hi: int = knob(0, help="forced interruption: highest length (tokens)")
    interrupt_text: str = knob(
        "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>",
        help="text injected at the interruption point (not trained on)",
    )
    answer_budget: int = knob(0, help="policy tokens allowed after the injected text")
    decode_chunk: int = knob(0, help="decode in chunks of this many tokens (0 = one loop)")
    engine: bool = knob(
        True,
        help="batches and evaluation generate through the continuous-batching engine "
        "(false: the batch Sampler, for on_policy and ppo_off_policy only: PipelineRL and "
        "split mode run as a stream on the engine). Not part of a run's id: the same tokens "
        "either way",
    )
    engine_slots: int = knob(
        0,
        help="the engine's decode slots (0 = every row of a batch: B_p x n, x k for "
        "ppo_off_policy, x W for PipelineRL's W batches in flight; evaluation: "
        "eval.num_prompts x eval.k)",
    )

    def __post_init__(self):
        check_numbers("sampling", self)
        check_range("sampling", "n", self.n, lo=1, hi=MAX_SAMPLES)
        check_range("sampling", "temperature", self.temperature, lo=0.0)
        check_range("sampling", "top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        check_range("sampling", "top_k", self.top_k, lo=0)
        check_range("sampling", "max_new_tokens", self.max_new_tokens, lo=1, hi=MAX_TOKENS)
        check_range("sampling", "max_prompt_len", self.max_prompt_len, lo=0, hi=MAX_TOKENS)
        check_range("sampling", "length_bucket", self.length_bucket, lo=1, hi=MAX_TOKENS)
        for k in ("decode_chunk", "engine_slots", "interrupt_lo", "interrupt_hi", "answer_budget"):
            check_range("sampling", k, getattr(self, k), lo=0, hi=MAX_TOKENS)
        check_choice("sampling", "length_control", self.length_control, LENGTH_CONTROL)
        if self.length_control == "interrupt" and not 0 < self.interrupt_lo <= self.interrupt_hi:
            raise ConfigError(
                "sampling.length_control='interrupt' needs 0 < sampling.interrupt_lo <= "
                f"sampling.interrupt_hi, got {self.interrupt_lo}, {self.interrupt_hi}"
            )
        if self.length_control == "interrupt" and self.answer_budget < 1:
            raise ConfigError(
                "sampling.length_control='interrupt' needs sampling.answer_budget >= 1 (tokens "
                f"the model may answer with after the injected text), got {self.answer_budget}"
            )
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ConfigError(f"sampling.stop_token_ids must be token ids >= 0, got {bad}")
        if self.ignore_eos and self.stop_token_ids:
            raise ConfigError(
                f"sampling.ignore_eos=true contradicts sampling.stop_token_ids="
                f"{list(self.stop_token_ids)}: set one of them"
            )
