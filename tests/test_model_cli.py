"""`rl-jax score` and `rl-jax convert`, in process through the real CLI dispatcher."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.cli import main as cli
from rl_jax.config import ModelConfig
from rl_jax.models import build_model, export_hf, host_params, load_model, resolve_spec
from rl_jax.models.logprobs import token_logprobs
from rl_jax.models.native import is_native_dir, save_model

SPEC = resolve_spec(
    ModelConfig(
        preset="",
        architecture="qwen3",
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        tie_embeddings="false",
    )
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("hf")
    export_hf(build_model(SPEC, seed=3), d)
    words = ["<eos>"] + [f"w{i}" for i in range(SPEC.vocab_size - 2)] + ["[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return d


def run_json(capsys, argv):
    assert cli(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_score_token_ids_and_text(hf_dir, capsys):
    ids = [5, 9, 1, 30, 7, 7]
    got = run_json(
        capsys, ["score", "--model", str(hf_dir), "--token-ids", ",".join(map(str, ids))]
    )
    assert got["token_ids"] == ids and len(got["logprobs"]) == len(ids) - 1
    model = load_model(hf_dir)
    want = nnx.jit(lambda m, t: token_logprobs(m, t)[0])(model, jnp.asarray([ids]))
    np.testing.assert_allclose(got["logprobs"], np.asarray(want)[0, :-1], atol=1e-6)
    by_text = run_json(capsys, ["score", "--model", str(hf_dir), "--text", "w4 w8 w0 w29 w6 w6"])
    assert by_text["token_ids"] == ids
    np.testing.assert_allclose(by_text["logprobs"], got["logprobs"], atol=1e-6)


def test_score_errors_exit_2(hf_dir, tmp_path, capsys):
    assert cli(["score", "--model", str(hf_dir), "--token-ids", "1,x"]) == 2
    assert cli(["score", "--model", str(hf_dir), "--token-ids", "1,400"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert cli(["score", "--model", str(tmp_path), "--token-ids", "1,2"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_convert_round_trip(hf_dir, tmp_path, capsys):
    native = tmp_path / "native"
    s = run_json(capsys, ["convert", str(hf_dir), str(native)])
    assert (s["from"], s["to"]) == ("hf", "rl_jax") and is_native_dir(native)
    assert (native / "tokenizer.json").is_file()
    back = tmp_path / "back"
    s = run_json(capsys, ["convert", str(native), str(back)])
    assert (s["from"], s["to"]) == ("rl_jax", "hf")
    a, b = host_params(load_model(hf_dir)), host_params(load_model(back))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    half = tmp_path / "bf16"
    run_json(capsys, ["convert", str(hf_dir), str(half), "--to", "hf", "--dtype", "bfloat16"])
    cfg = json.loads((half / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    np.testing.assert_allclose(
        host_params(load_model(half))["q"], a["q"], rtol=1e-2, atol=1e-3
    )  # bf16 keeps 8 mantissa bits


def test_native_dir_keeps_value_head(tmp_path):
    spec = dataclasses.replace(SPEC, value_head=True)
    m = build_model(spec, seed=4)
    m.value_w[...] = jnp.arange(spec.hidden_size, dtype=jnp.float32)
    save_model(m, tmp_path)
    again = load_model(ModelConfig(path=str(tmp_path), value_head=True))
    np.testing.assert_array_equal(again.value_w[...], np.arange(spec.hidden_size))
    assert again.spec == spec


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("vocab_size", "40", "an integer"),
        ("hidden_size", 32.0, "an integer"),
        ("rope_theta", "1e4", "a number"),
        ("tie_embeddings", "false", "true or false"),
        ("eos_token_ids", 5, "a list of ints"),
        ("architecture", ["qwen3"], "a string"),
    ],
)
def test_native_spec_field_types_are_checked(tmp_path, field, value, what):
    """rl_jax_model.json's spec fields of the wrong JSON type: a CheckpointError naming the
    file and field, not a TypeError at build nor a string "false" read as true."""
    from rl_jax.models.hf import CheckpointError

    save_model(build_model(SPEC, seed=0), tmp_path)
    f = tmp_path / "rl_jax_model.json"
    data = json.loads(f.read_text())
    data["spec"][field] = value
    f.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"rl_jax_model.json: spec field {field}=.* {what}"):
        resolve_spec(ModelConfig(path=str(tmp_path)))


def test_convert_writes_only_into_a_new_empty_or_previous_export(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "notes.txt").write_text("keep me")
    assert cli(["convert", str(hf_dir), str(out), "--to", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "notes.txt" in err and "--force" in err, err
    assert (out / "config.json").read_text() == '{"mine": true}'
    # --force: the export's files are written, the others kept.
    run_json(capsys, ["convert", str(hf_dir), str(out), "--to", "hf", "--force"])
    assert (out / "notes.txt").read_text() == "keep me"
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    # A previous export of the same kind is replaced whole: shards and a tokenizer that
    # the new export does not have are gone.
    (out / "notes.txt").unlink()
    run_json(capsys, ["convert", str(hf_dir), str(out), "--to", "hf", "--max-shard-gb", "1e-5"])
    assert (out / "model.safetensors.index.json").is_file()
    bare = tmp_path / "bare"
    save_model(build_model(SPEC, seed=5), bare)  # no tokenizer files
    run_json(capsys, ["convert", str(bare), str(out)])
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    np.testing.assert_array_equal(
        host_params(load_model(out))["q"], host_params(load_model(bare))["q"]
    )
    # An export of the other kind is another model's directory; a file is not a directory.
    assert cli(["convert", str(hf_dir), str(bare), "--to", "hf"]) == 2
    assert "not a previous hf export" in capsys.readouterr().err
    assert cli(["convert", str(hf_dir), str(out / "config.json")]) == 2
    assert "is a file" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_json(capsys, ["convert", str(hf_dir), str(empty)])["to"] == "rl_jax"


def test_convert_keeps_the_sources_generation_config(hf_dir, tmp_path, capsys):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    gen = {"eos_token_id": [0, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(gen))
    native, back = tmp_path / "native", tmp_path / "back"
    run_json(capsys, ["convert", str(src), str(native)])
    run_json(capsys, ["convert", str(native), str(back)])
    for d in (native, back):
        got = json.loads((d / "generation_config.json").read_text())
        assert {k: got[k] for k in gen} == gen, d
    assert load_tokenizer_ids(back, "w4 w8") == load_tokenizer_ids(src, "w4 w8")


def load_tokenizer_ids(path, text):
    from rl_jax.models.tokenizer import load_tokenizer

    return load_tokenizer(path).encode(text)


@pytest.mark.parametrize("temperature", ["nan", "inf"])
def test_score_temperature_must_be_finite(hf_dir, capsys, temperature):
    # Logits divided by NaN printed NaN log-probs (invalid JSON); by inf, a uniform model.
    argv = ["score", "--model", str(hf_dir), "--token-ids", "1,2", f"--temperature={temperature}"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--temperature" in err and "finite" in err, err


def test_score_one_token_outside_the_vocab_refused(hf_dir, capsys):
    # One token has no log-prob to score, but an id the model has no row for is still refused.
    assert cli(["score", "--model", str(hf_dir), "--token-ids", "400"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[400] are outside the vocabulary [0, 40)" in err, err
    assert run_json(capsys, ["score", "--model", str(hf_dir), "--token-ids", "4"])["logprobs"] == []


def test_score_chunk_below_minus_one_refused(hf_dir, capsys):
    # A negative chunk other than -1 (auto) reached the LM head's map and raised ValueError.
    assert cli(["score", "--model", str(hf_dir), "--token-ids", "1,2,3", "--chunk=-5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--chunk=-5 must be >= -1" in err, err


@pytest.mark.parametrize("gb", ["nan", "inf", "-1", "0"])
def test_convert_max_shard_gb_must_be_a_finite_number_above_zero(hf_dir, tmp_path, capsys, gb):
    # NaN raised ValueError once the model had loaded; -1 and 0 wrote a file per tensor.
    out = tmp_path / "out"
    assert cli(["convert", str(hf_dir), str(out), "--to", "hf", f"--max-shard-gb={gb}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-shard-gb" in err, err
    assert not out.exists()
