"""Sampling configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rl_jax.knobs import (
    ConfigError,
    DependentKnobError,
    check_choice,
    check_numbers,
    check_range,
    knob,
)

LENGTH_CONTROL = ("truncate", "interrupt")
# Bounds that catch a typo before it becomes a host allocation of that many rows or tokens.
MAX_SAMPLES = 1 << 16
MAX_TOKENS = 1 << 20
# The forced interruption's knobs that 0 leaves to `SamplingConfig.interrupt_window`.
_WINDOW = ("interrupt_lo", "interrupt_hi", "answer_budget")


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
        help="longest prompt in tokens: longer ones are dropped at start; the engine pads "
        "prompts to the data's longest, rounded up to length_bucket, at most this (0 = "
        "auto: no limit; lazily read datasets are padded to an explicit limit)",
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
    interrupt_lo: int = knob(
        0,
        help="forced interruption: lowest length (tokens; 0 = interrupt_hi minus the answer "
        "budget)",
    )
    interrupt_hi: int = knob(
        0,
        help="forced interruption: highest length (tokens; 0 = as late as the injected text "
        "and the answer budget still fit in max_new_tokens)",
    )
    interrupt_text: str = knob(
        "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>",
        help="text injected at the interruption point (not trained on)",
    )
    answer_budget: int = knob(
        0,
        help="policy tokens allowed after the injected text (0 = a seventh of max_new_tokens, "
        "ScaleRL's 2048 of 14336)",
    )
    decode_chunk: int = knob(0, help="decode in chunks of this many tokens (0 = one loop)")
    engine_slots: int = knob(
        0,
        help="the engine's decode slots (0 = every row of a batch: B_p x n, x k for "
        "ppo_off_policy, x W for PipelineRL's W batches in flight; evaluation: "
        "eval.num_prompts x eval.k)",
    )

    def interrupt_window(self) -> tuple[int, int, int]:
        """(interrupt_lo, interrupt_hi, answer_budget), the unset (0) ones filled in ScaleRL's
        proportions (a budget of 14336 tokens: interruptions in [10240, 12288], 2048 tokens to
        answer): the answer budget a seventh of max_new_tokens; interrupt_hi as late as the
        injected text and that budget still fit (the text's UTF-8 bytes + 1 bound its tokens
        under byte-level and byte-fallback tokenizers); interrupt_lo one answer budget
        earlier."""
        budget = self.answer_budget or max(1, self.max_new_tokens // 7)
        text = len(self.interrupt_text.encode("utf-8")) + 1
        hi = self.interrupt_hi or self.max_new_tokens - budget - text
        return self.interrupt_lo or max(1, hi - budget), hi, budget

    def resolved(self) -> SamplingConfig:
        """Under length_control='interrupt', the unset parts of `interrupt_window` filled in;
        idempotent."""
        if self.length_control != "interrupt" or all(getattr(self, k) for k in _WINDOW):
            return self
        lo, hi, budget = self.interrupt_window()
        return dataclasses.replace(self, interrupt_lo=lo, interrupt_hi=hi, answer_budget=budget)

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
        if self.length_control == "interrupt":
            lo, hi, _ = self.interrupt_window()
            if not 0 < lo <= hi:
                auto = [k for k in _WINDOW if not getattr(self, k)]
                raise ConfigError(
                    "sampling.length_control='interrupt' needs 0 < sampling.interrupt_lo <= "
                    f"sampling.interrupt_hi, got {lo}, {hi}"
                    + (
                        f" ({', '.join(auto)} filled in: sampling.max_new_tokens="
                        f"{self.max_new_tokens} leaves no room for an interruption before the "
                        f"sampling.interrupt_text ({len(self.interrupt_text.encode('utf-8'))} "
                        "bytes) and an answer)"
                        if auto
                        else ""
                    )
                )
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or t < 0]
        if bad:
            raise ConfigError(f"sampling.stop_token_ids must be token ids >= 0, got {bad}")
        if self.ignore_eos and self.stop_token_ids:
            raise DependentKnobError(
                f"sampling.ignore_eos=true contradicts sampling.stop_token_ids="
                f"{list(self.stop_token_ids)}: set one of them",
                knob="sampling.stop_token_ids",
                on=("sampling.ignore_eos",),
            )
