"""Prompt data and curriculum configuration."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass

from rl_jax.config._mixture import BATCH_KNOBS as BATCH_KNOBS  # the trainer's warm-up
from rl_jax.config._mixture import (
    INHERITED,
    MIXTURE_ONLY,
    canonical_mixture,
    parse_mixture,
)
from rl_jax.knobs import (
    ConfigError,
    DependentKnobError,
    check_choice,
    check_numbers,
    check_range,
    knob,
)

# Record layouts of code problems (rl_jax.data._code_layouts); their verifier is `code`.
CODE_FORMATS = ("code", "mbpp", "humaneval", "apps", "livecodebench")
SOURCES = ("arith", "countdown", "code", "file", "hf", "tfds", "reasoning_gym")
# Sources whose problems are generated here (val_size counts extra problems generated).
GENERATED = ("arith", "countdown", "code", "reasoning_gym")
# Sources of datasets read from disk (val_size problems are held out of them).
DATASETS = ("file", "hf")
# data.val_size=0 (auto): this many generated validation problems; of a dataset, 10% of its
# problems up to this many.
AUTO_VAL_SIZE = 128
AUTO_VAL_FRAC = 0.1
FILE_FORMATS = ("auto", "gsm8k", "math", "polaris", "jsonl", *CODE_FORMATS)
# Sources whose problems are records read in a layout (data.format and the field knobs).
RECORD_SOURCES = ("file", "hf", "tfds")
# How an answer is read from its field: auto = the layout's own; none = the whole field;
# gsm8k = after the last '####'; boxed = the last \boxed{...}; regex = data.answer_regex.
ANSWER_EXTRACTS = ("auto", "none", "gsm8k", "boxed", "regex")
ARITH_TASKS = ("add", "sub", "mul", "chain")
# data.difficulty's range by source (any other source: >= 1).
DIFFICULTY = {"arith": (1, 18), "countdown": (2, 8), "code": (1, 3)}
# Generated sources build every problem in memory up front: a typo'd size must not hang.
MAX_PROBLEMS = 1 << 24


@contextlib.contextmanager
def _depends_on_source(name: str):
    """A refusal of data.<name> inside is one for data.source's value (DependentKnobError)."""
    try:
        yield
    except DependentKnobError:
        raise
    except ConfigError as e:
        raise DependentKnobError(str(e), knob=f"data.{name}", on=("data.source",)) from None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = knob("arith", help=f"prompt source, one of {SOURCES}")
    task: str = knob(
        "add",
        help=f"arith: one of {ARITH_TASKS}; reasoning_gym: dataset name; "
        "tfds: dataset name (e.g. from rl_jax.data.prepare_tfds)",
    )
    difficulty: int = knob(
        2,
        help="arith: digits per operand; countdown: how many numbers (2..8); code: 1 (one "
        "operation), 2 (strings and lists), 3 (loops)",
    )
    num_terms: int = knob(3, help="arith task=chain: number of terms summed")
    path: str = knob(
        "",
        help="source=file: JSONL/parquet training file; source=hf: a `save_to_disk` directory "
        "or a hub dataset name; source=tfds: data_dir ('' = default); files and directories "
        "may be URLs (gs://...)",
    )
    hf_split: str = knob(
        "train", help="source=hf: split of a DatasetDict / hub dataset to train on"
    )
    hf_val_split: str = knob(
        "", help="source=hf: split to validate on ('' = hold out val_size problems of hf_split)"
    )
    val_path: str = knob(
        "",
        help="source=file: validation file, local or a URL ('' = hold out val_size problems "
        "of data.path)",
    )
    format: str = knob(
        "auto",
        help=f"file/hf/tfds record layout, one of {FILE_FORMATS} (docs/data.md lists their "
        "fields; auto: from the first record's fields)",
    )
    question_field: str = knob(
        "", help="file/hf/tfds: the record field holding the question ('' = the layout's)"
    )
    answer_field: str = knob(
        "", help="file/hf/tfds: the record field the answer is read from ('' = the layout's)"
    )
    answer_extract: str = knob(
        "auto",
        help=f"how the answer is read from its field, one of {ANSWER_EXTRACTS}: auto (the "
        "layout's), none (the whole field), gsm8k (after the last '####'), boxed (the last "
        "\\boxed{...}), regex (data.answer_regex); a row whose answer cannot be read is "
        "dropped and counted",
    )
    answer_regex: str = knob(
        "",
        help="regular expression the answer is read with (answer_extract=regex, which it "
        "implies under auto): its last match's first group (or whole match if it has none)",
    )
    gym_kwargs: str = knob("", help="source=reasoning_gym: JSON object of dataset options")
    split_file: str = knob(
        "", help="difficulty split file (IsoCompute easy/hard) to select from, local or a URL"
    )
    split_name: str = knob("", help="split of split_file to train and validate on (easy, hard...)")
    train_size: int = knob(
        4096, help="generated sources: training problems (file/tfds use every problem)"
    )
    val_size: float = knob(
        0,
        help="validation problems: a count (>= 1) or a fraction (< 1) of the problems "
        "(generated sources: of train_size); 0 = auto: 128 generated, or 10% of a file / HF "
        "dataset up to 128 (held out of it unless data.val_path / data.hf_val_split)",
    )
    prompts_per_batch: int = knob(8, help="prompts per batch (B_p, IsoCompute)")
    seed: int = knob(0, help="data seed (generation, held-out split, shuffling)")
    reverse_digits: bool = knob(
        True, help="arith: answers written least-significant digit first (46 -> '64')"
    )
    prompt_template: str = knob(
        "{question}", help="template of each prompt; '{question}' is replaced by the question"
    )
    chat_template: bool = knob(
        True,
        help="render each prompt as a user message with the model's chat template (when its "
        "tokenizer ships one; false = plain text)",
    )
    system_prompt: str = knob(
        "", help="system message before each prompt ('' = none; plain text without a template)"
    )
    answer_instruction: str = knob(
        "auto",
        help="appended to each question after a blank line; 'auto' = how the verifier reads "
        "answers (numeric: '#### <number>', math: \\boxed{}) for file/hf/tfds data with the "
        "plain '{question}' prompt_template, else nothing; '' = none",
    )
    zero_variance_filter: bool = knob(
        True,
        help="drop groups whose shaped rewards (those the advantages read) are all equal "
        "from the loss (ScaleRL)",
    )
    no_positive_resampling: bool = knob(
        True, help="retire prompts with pass rate >= npr_threshold from later epochs (ScaleRL)"
    )
    npr_threshold: float = knob(0.9, help="No-Positive-Resampling pass-rate threshold")
    dynamic_sampling: bool = knob(False, help="DAPO: resample until B_p groups have variance")
    max_resample_rounds: int = knob(4, help="bound on DAPO dynamic-sampling rounds")
    mixture: str = knob(
        "",
        help="several sources in one run: 'arith:1,code:1' (sources, weights) or a mapping "
        "{name: {weight, reward, data knobs}} (YAML/JSON); each batch draws from them in "
        "those proportions, validation reports val/<name>/pass@1 per task (docs/code.md); "
        "'' = one source (data.source)",
    )

    def __post_init__(self):
        check_numbers("data", self)
        if self.mixture:
            self._check_mixture()
        check_choice("data", "source", self.source, SOURCES)
        check_choice("data", "format", self.format, FILE_FORMATS)
        # What data.task and data.difficulty mean, and so what they allow, is the source's.
        with _depends_on_source("task"):
            if self.source == "arith":
                check_choice("data", "task", self.task, ARITH_TASKS)
        with _depends_on_source("difficulty"):
            lo, hi = DIFFICULTY.get(self.source, (1, None))
            check_range("data", "difficulty", self.difficulty, lo=lo, hi=hi)
        if self.source == "file" and not self.path:
            raise ConfigError("data.source='file' needs data.path (a JSONL or parquet file)")
        if self.source == "hf" and not self.path:
            raise ConfigError(
                "data.source='hf' needs data.path (a datasets `save_to_disk` directory or a "
                "hub dataset name)"
            )
        if self.source == "hf" and not self.hf_split:
            raise ConfigError("data.hf_split is empty; name the split to train on (e.g. train)")
        if self.source in ("tfds", "reasoning_gym") and not self.task:
            raise ConfigError(f"data.source={self.source!r} needs data.task (the dataset name)")
        check_range("data", "num_terms", self.num_terms, lo=2, hi=1000)
        check_range("data", "train_size", self.train_size, lo=1, hi=MAX_PROBLEMS)
        # Every run evaluates (at least at the end): it needs validation problems.
        check_range("data", "val_size", self.val_size, lo=0, hi=MAX_PROBLEMS)
        if self.val_size >= 1 and self.val_size != int(self.val_size):
            raise ConfigError(
                f"data.val_size={self.val_size!r}: a count must be a whole number (or a "
                "fraction below 1, or 0 for auto)"
            )
        check_range("data", "prompts_per_batch", self.prompts_per_batch, lo=1, hi=MAX_PROBLEMS)
        # numpy's SeedSequence refuses negative entropy.
        check_range("data", "seed", self.seed, lo=0)
        check_range("data", "npr_threshold", self.npr_threshold, lo=0.0, hi=1.0)
        check_range("data", "max_resample_rounds", self.max_resample_rounds, lo=1)
        if "{question}" not in self.prompt_template:
            raise ConfigError(
                f"data.prompt_template={self.prompt_template!r} must contain '{{question}}'"
            )
        self._check_fields()
        if bool(self.split_file) != bool(self.split_name):
            raise ConfigError(
                "data.split_file and data.split_name go together; got "
                f"split_file={self.split_file!r}, split_name={self.split_name!r}"
            )

    def _check_mixture(self) -> None:
        """A mixture's tasks parse; the knobs only a task reads are left at their defaults
        here (a recipe's value goes back to its default when an override sets a mixture)."""
        for f in dataclasses.fields(self):
            if f.name in MIXTURE_ONLY or f.name in INHERITED:
                continue
            if getattr(self, f.name) != f.default:
                # Either wins: a mixture set here drops the recipe's single source, and a
                # source set here drops the recipe's mixture.
                raise DependentKnobError(
                    f"data.{f.name}={getattr(self, f.name)!r} is a task's knob: with "
                    "data.mixture set it goes in a task's settings (data.mixture='{name: "
                    f"{{{f.name}: ...}}}}')",
                    knob=f"data.{f.name}",
                    on=("data.mixture",),
                    mutual=True,
                )
        for t in self.mixture_tasks():
            t.data(self)  # each task's own knobs, checked as a DataConfig

    def mixture_tasks(self):
        """The tasks of data.mixture (rl_jax.config._mixture.MixtureTask); () without one."""
        if not self.mixture:
            return ()
        return parse_mixture(self.mixture, data_cls=DataConfig, sources=SOURCES)

    def canonical_mixture(self) -> str:
        """data.mixture in one spelling (JSON, weights normalized; '' without one)."""
        return canonical_mixture(self.mixture_tasks()) if self.mixture else ""

    def _check_fields(self) -> None:
        check_choice("data", "answer_extract", self.answer_extract, ANSWER_EXTRACTS)
        if self.source not in RECORD_SOURCES:
            for name in ("question_field", "answer_field", "answer_regex"):
                if getattr(self, name):
                    raise DependentKnobError(
                        f"data.{name}={getattr(self, name)!r} reads records: it needs "
                        f"data.source in {RECORD_SOURCES}, got {self.source!r}",
                        knob=f"data.{name}",
                        on=("data.source",),
                    )
        if self.answer_regex:
            if self.answer_extract not in ("auto", "regex"):
                raise DependentKnobError(
                    f"data.answer_regex={self.answer_regex!r} is read with "
                    f"data.answer_extract=regex (or auto), got {self.answer_extract!r}",
                    knob="data.answer_regex",
                    on=("data.answer_extract",),
                )
            try:
                re.compile(self.answer_regex)
            except re.error as e:
                raise ConfigError(
                    f"data.answer_regex={self.answer_regex!r} is not a regular expression ({e})"
                ) from None
        elif self.answer_extract == "regex":
            raise ConfigError("data.answer_extract='regex' needs data.answer_regex (a pattern)")

    @property
    def extract(self) -> str:
        """answer_extract with auto + a regex read as regex."""
        return (
            "regex" if self.answer_regex and self.answer_extract == "auto" else self.answer_extract
        )

    def val_count(self, num_problems: int) -> int:
        """Validation problems held out of a dataset of `num_problems` (a generated source:
        generated beside train_size of them); at least 1."""
        v = self.val_size
        if v >= 1:
            return int(v)
        if self.source in GENERATED:
            return AUTO_VAL_SIZE if v == 0 else max(1, round(v * self.train_size))
        if v == 0:
            return min(AUTO_VAL_SIZE, max(1, round(AUTO_VAL_FRAC * num_problems)))
        return max(1, round(v * num_problems))

    @property
    def generated_val_size(self) -> int:
        """Validation problems a generated source makes (`val_count` of train_size)."""
        return self.val_count(self.train_size)
