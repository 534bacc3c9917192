"""`rl-jax sample` end to end on a tiny exported model with a word-level tokenizer."""

import json

import pytest

from rl_jax.cli import main as rl_jax_main
from rl_jax.config import ConfigError, ModelConfig
from rl_jax.models import build_model, export_hf, resolve_spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny_hf")
    spec = resolve_spec(ModelConfig(preset="tiny", num_layers=1))
    export_hf(build_model(spec, seed=3), d)
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>"])}
    for w in "hello world how are you ? 1 2 3 + =".split():
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), spec.vocab_size - 1):
        vocab[f"w{i}"] = i
    vocab["[UNK]"] = spec.vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<pad>", "</s>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "<pad>"})
    )
    return d


def _rows(capsys):
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_sample_json_rows(model_dir, capsys):
    common = ["sampling.max_new_tokens=6", "sampling.temperature=0", "sampling.length_bucket=8"]
    argv = ["sample", "--model", str(model_dir), "--prompt", "hello world", "--json"]
    assert rl_jax_main(argv + ["sampling.n=2"] + common) == 0
    rows = _rows(capsys)
    assert len(rows) == 2 and rows[0]["token_ids"] == rows[1]["token_ids"]  # greedy
    for i, r in enumerate(rows):
        assert r["prompt_index"] == 0 and r["sample_index"] == i
        assert 1 <= len(r["token_ids"]) == len(r["logprobs"]) == r["length"] <= 6
        assert r["finish_reason"] in ("stop", "length")
        assert r["truncated"] == (r["finish_reason"] == "length")
        assert all(lp <= 0 for lp in r["logprobs"]) and isinstance(r["text"], str)
        if r["finish_reason"] == "stop":
            assert r["token_ids"][-1] == 1  # </s>

    # Token ids pass untouched: the same prompt as ids gives the same rows.
    ids = "2,3"  # "hello world"
    argv = ["sample", "--model", str(model_dir), "--prompt-token-ids", ids, "--json"]
    assert rl_jax_main(argv + ["sampling.n=1"] + common) == 0
    assert _rows(capsys)[0]["token_ids"] == rows[0]["token_ids"]


def test_sample_prompts_file_text_output(model_dir, tmp_path, capsys):
    f = tmp_path / "prompts.txt"
    f.write_text('how are you ?\n{"token_ids": [4, 5]}\n\n1 + 2 =\n')
    argv = ["sample", "--model", str(model_dir), "--prompts", str(f), "sampling.n=1"]
    assert rl_jax_main(argv + ["sampling.max_new_tokens=4", "sampling.length_bucket=8"]) == 0
    out = capsys.readouterr().out
    assert [line.startswith("--- prompt") for line in out.splitlines()].count(True) == 3


def test_sample_errors(model_dir, tmp_path):
    from rl_jax.cli.sample import main

    with pytest.raises(ConfigError, match="comma-separated"):
        main(["--model", str(model_dir), "--prompt-token-ids", "1,x"])
    with pytest.raises(ConfigError, match="no such file"):
        main(["--model", str(model_dir), "--prompts", str(tmp_path / "none.txt")])
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((model_dir / f).read_bytes())
    with pytest.raises(ConfigError, match="no tokenizer"):
        main(["--model", str(bare), "--prompt", "hello"])


@pytest.mark.parametrize("ids", ["2,64", "-1,2", "99999999999999999999999"])
def test_sample_refuses_token_ids_outside_the_vocabulary(model_dir, capsys, ids):
    # The tiny model's vocabulary is [0, 64): an id outside it was clamped by the embedding
    # lookup and sampled from (a huge one raised OverflowError).
    argv = ["sample", "--model", str(model_dir), f"--prompt-token-ids={ids}", "sampling.n=1"]
    assert rl_jax_main(argv + ["sampling.max_new_tokens=2", "sampling.length_bucket=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "outside the model's vocabulary [0, 64)" in err, err


def test_sample_refuses_token_ids_outside_the_vocabulary_in_a_prompts_file(model_dir, tmp_path):
    from rl_jax.cli.sample import main

    f = tmp_path / "prompts.txt"
    f.write_text('hello world\n{"token_ids": [4, 70]}\n')
    with pytest.raises(ConfigError, match=r"prompt 1: token ids \[70\]"):
        main(["--model", str(model_dir), "--prompts", str(f), "sampling.max_new_tokens=2"])


def test_sample_refuses_a_seed_that_does_not_fit_64_bits(model_dir, capsys):
    argv = ["sample", "--model", str(model_dir), "--prompt", "hello", "--seed", str(2**64)]
    assert rl_jax_main(argv + ["sampling.n=1", "sampling.max_new_tokens=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--seed={2**64} must fit a 64-bit integer" in err, err
