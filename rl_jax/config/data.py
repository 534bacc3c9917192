"""Prompt data and curriculum configuration."""

from __future__ import annotations

from dataclasses import dataclass

from rl_jax.knobs import check_choice, check_range, knob

SOURCES = ("arith", "countdown", "file", "tfds", "reasoning_gym")
FILE_FORMATS = ("auto", "gsm8k", "math", "polaris", "jsonl")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = knob("arith", help=f"prompt source, one of {SOURCES}")
    task: str = knob(
        "add", help="task variant (arith: add/sub/mul/chain; reasoning_gym: dataset name)"
    )
    difficulty: int = knob(
        2, help="difficulty knob (arith: digits per operand; countdown: numbers)"
    )
    path: str = knob("", help="local dataset file (JSONL or parquet) for source=file/tfds")
    format: str = knob("auto", help=f"file layout, one of {FILE_FORMATS}")
    split_file: str = knob("", help="difficulty split file (IsoCompute easy/hard) to select from")
    split_name: str = knob("", help="split in split_file to train on ('' = all)")
    train_size: int = knob(4096, help="number of generated training problems")
    val_size: int = knob(128, help="number of held-out validation problems")
    prompts_per_batch: int = knob(8, help="prompts per batch (B_p, IsoCompute)")
    seed: int = knob(0, help="data seed (shuffling and generation)")
    reverse_digits: bool = knob(True, help="arith: answers written least-significant digit first")
    prompt_template: str = knob("{question}", help="template applied to each question")
    zero_variance_filter: bool = knob(
        True, help="drop groups whose rewards are all equal (ScaleRL)"
    )
    no_positive_resampling: bool = knob(True, help="retire prompts with pass rate >= npr_threshold")
    npr_threshold: float = knob(0.9, help="No-Positive-Resampling pass-rate threshold")
    dynamic_sampling: bool = knob(False, help="DAPO: resample until B_p groups have variance")
    max_resample_rounds: int = knob(4, help="bound on DAPO dynamic-sampling rounds")

    def __post_init__(self):
        check_choice("data", "source", self.source, SOURCES)
        check_choice("data", "format", self.format, FILE_FORMATS)
        check_range("data", "prompts_per_batch", self.prompts_per_batch, lo=1)
        check_range("data", "npr_threshold", self.npr_threshold, lo=0.0, hi=1.0)
        check_range("data", "difficulty", self.difficulty, lo=1)
