"""HF checkpoints: parity with transformers, export round trip, config spellings, errors."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rl_jax.config import MeshConfig, ModelConfig
from rl_jax.models import host_params, resolve_spec, token_logprobs
from rl_jax.models.hf import (
    CheckpointError,
    export_hf,
    load_hf,
    spec_fields_from_hf_config,
)
from rl_jax.models.load import load_model
from rl_jax.models.safetensors_io import open_safetensors, write_safetensors
from rl_jax.models.tokenizer import HFTokenizer
from rl_jax.sharding import make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.parity

V = 48
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def hf_config(arch):
    if arch == "llama":  # Llama 3.1 RoPE scaling, all attention biases, untied head
        return transformers.LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rope_theta=500.0,
        )
    if arch == "qwen2":  # q/k/v biases, tied head
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    # q/k RMSNorm, head_dim != hidden / heads
    return transformers.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    torch.manual_seed(0)
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(arch)).float().eval()
        with torch.no_grad():  # large random weights: biases and norms must matter
            for p in model.parameters():
                p.normal_(0.0, 0.3)
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(d)
        out[arch] = (d, model)
    return out


TOKENS = np.random.default_rng(0).integers(0, V, (2, 17))


def hf_logprobs(model, toks=TOKENS):
    with torch.no_grad():
        logits = model(torch.tensor(toks)).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1]
    return lp.gather(-1, torch.tensor(toks[:, 1:, None]))[..., 0].numpy()


@nnx.jit
def our_logprobs(model, toks):
    return token_logprobs(model, toks, chunk=5)[0][:, :-1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_load_and_export_match_transformers(arch, hf_dirs, tmp_path):
    d, hf_model = hf_dirs[arch]
    want = hf_logprobs(hf_model)
    ours = load_hf(d)
    assert ours.spec.architecture == arch
    np.testing.assert_allclose(our_logprobs(ours, jnp.asarray(TOKENS)), want, atol=1e-4)
    # rl_jax -> HF directory -> transformers: same log-probs
    out = export_hf(ours, tmp_path / "export")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_logprobs(back), want, atol=1e-4)


@pytest.mark.devices(8)
def test_sharded_load_reads_slices_into_place(hf_dirs):
    d, _ = hf_dirs["qwen3"]
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    sharded = load_model(d, mesh=mesh)
    q = sharded.layers.q[...]
    assert tuple(q.sharding.spec)[:3] == (None, "fsdp", "tensor")
    assert q.addressable_shards[0].data.shape[1:] == (8, 2, 16)
    plain = host_params(load_model(d))
    for name, arr in host_params(sharded).items():
        np.testing.assert_array_equal(arr, plain[name], err_msg=name)


def test_sharded_index_and_bf16_checkpoints(hf_dirs, tmp_path):
    _, hf_model = hf_dirs["qwen2"]
    d = tmp_path / "bf16_sharded"
    hf_model.to(torch.bfloat16).save_pretrained(d, max_shard_size="20KB")
    hf_model.float()
    assert (d / "model.safetensors.index.json").is_file()
    ours = host_params(load_hf(d))
    ref = hf_model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours["embed"], ref)
    # our own sharded export reads back identically
    m = load_hf(hf_dirs["qwen2"][0])
    out = export_hf(m, tmp_path / "ours_sharded", max_shard_bytes=8_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    again = host_params(load_hf(out))
    for name, arr in host_params(m).items():
        np.testing.assert_array_equal(again[name], arr, err_msg=name)


def test_config_json_spellings_agree():
    v5 = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [1, 2],
    }
    v4 = {k: v for k, v in v5.items() if k not in ("dtype", "rope_parameters")}
    v4["torch_dtype"] = "bfloat16"
    v4["rope_theta"] = 500000.0
    v4["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    a, b = spec_fields_from_hf_config(v5), spec_fields_from_hf_config(v4)
    assert a == b
    assert a["rope_theta"] == 500000.0 and a["rope_scaling"].factor == 32.0
    assert a["eos_token_ids"] == (1, 2)


def test_checkpoint_errors_name_the_problem(hf_dirs, tmp_path):
    d, _ = hf_dirs["llama"]
    # missing tensor
    bad = tmp_path / "missing"
    shutil.copytree(d, bad)
    tensors = open_safetensors(bad / "model.safetensors")
    kept = {k: np.array(v) for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    del tensors
    write_safetensors(bad / "model.safetensors", kept)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(bad)
    # wrong shape: the config claims a wider MLP than the tensors have
    wrong = tmp_path / "wrong"
    shutil.copytree(d, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj.*\(64, 32\).*\(96, 32\)"):
        load_hf(wrong)
    # unknown architecture
    gpt = tmp_path / "gpt2"
    shutil.copytree(d, gpt)
    cfg = json.loads((gpt / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (gpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gpt2.*GPT2LMHeadModel"):
        resolve_spec(ModelConfig(path=str(gpt)))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)


def test_tokenizer_from_dir_matches_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", "<pad>", "<|u|>", "<|a|>"])}
    for w in "hello world how are you ? 1 2 3".split():
        vocab.setdefault(w, len(vocab))
    vocab["[UNK]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<s>", "</s>", "<|u|>", "<|a|>"]])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'][0] + '|> ' + m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|a|>' }}{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    ours = HFTokenizer.from_dir(tmp_path)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (0, 1, 2)
    assert ours.vocab_size == len(vocab)
    msgs = [{"role": "user", "content": "how are you ?"}]
    text = ours.apply_chat_template(msgs)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert text == theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode("hello world")) == "hello world"
    # older configs serialize special tokens as AddedToken dicts
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|a|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert HFTokenizer.from_dir(tmp_path).eos_id == vocab["<|a|>"]


@pytest.mark.parametrize(
    "key",
    ["tie_word_embeddings", "attention_bias", "norm_topk_prob", "mlp_bias", "use_sliding_window"],
)
def test_config_json_booleans_must_be_json_booleans(key):
    """A string "false" is refused naming the key, not read as true (a tied lm_head)."""
    cfg = {
        "model_type": "qwen3_moe",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    null_tie = spec_fields_from_hf_config({**cfg, "tie_word_embeddings": None})
    assert null_tie["tie_embeddings"] is False
    with pytest.raises(CheckpointError, match=f"config.json: {key}='false' must be true or false"):
        spec_fields_from_hf_config({**cfg, key: "false"})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": ["qwen3"]}, r"model_type=\['qwen3'\] must be a string"),
        ({"architectures": [["Qwen3ForCausalLM"]]}, "architectures=.* must be a list of class"),
        ({"rope_scaling": "llama3"}, "rope_scaling='llama3' must be an object or null"),
        ({"rope_parameters": [10000.0]}, r"rope_parameters=\[10000.0\] must be an object"),
    ],
)
def test_config_json_wrong_types_name_the_key(change, match):
    """A config.json field of the wrong JSON type is a CheckpointError naming it, not a
    TypeError / AttributeError from deep in the reader."""
    cfg = {
        "model_type": "qwen3",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    with pytest.raises(CheckpointError, match="config.json: " + match):
        spec_fields_from_hf_config({**cfg, **change})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"factor": 0.0}, "factor=0.0 must be > 0"),
        ({"factor": -8.0}, "factor=-8.0 must be > 0"),
        ({"low_freq_factor": 0.0}, "low_freq_factor=0.0 must be > 0"),
        ({"high_freq_factor": 1.0}, "high_freq_factor=1.0 must be > low_freq_factor"),
        ({"original_max_position_embeddings": 0}, "original_max_position=0 must be > 0"),
    ],
)
def test_llama3_rope_scaling_values_are_checked(change, match):
    """Llama 3.1 rope_scaling the frequencies cannot be computed from (a division by zero
    or a negative frequency) is a CheckpointError naming config.json and the value, not a
    ZeroDivisionError at build or NaN logits."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rope_scaling": {**rope, **change},
    }
    with pytest.raises(CheckpointError, match="config.json: rope_scaling " + match):
        spec_fields_from_hf_config(cfg)


def _word_tokenizer_dir(d, tokenizer_config):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<eos>": 0, "hi": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", **tokenizer_config}))
    return d


@pytest.mark.parametrize(
    "template, match",
    [
        (["{{ x }}"], r"tokenizer_config.json: chat_template is a list; each entry must be"),
        ([{"template": "{{ x }}"}], r"tokenizer_config.json: chat_template is a list"),
        (5, r"tokenizer_config.json: chat_template=5 must be a string"),
        ("{% for %}", r"tokenizer_config.json: chat template does not parse"),
    ],
)
def test_damaged_chat_template_is_a_config_error_naming_the_file(tmp_path, template, match):
    """A chat template of the wrong shape or that does not parse is refused when the
    tokenizer is read (ConfigError naming tokenizer_config.json), not a KeyError /
    TypeError / TemplateSyntaxError traceback when the first prompt is rendered."""
    from rl_jax.knobs import ConfigError

    d = _word_tokenizer_dir(tmp_path, {"chat_template": template})
    with pytest.raises(ConfigError, match=match):
        HFTokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_raise_exception_is_a_config_error(tmp_path):
    from rl_jax.knobs import ConfigError

    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    )
    tok = HFTokenizer.from_dir(_word_tokenizer_dir(tmp_path, {"chat_template": template}))
    with pytest.raises(ConfigError, match=f"{tmp_path}: chat template failed: no system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


@pytest.mark.parametrize("eos", [-1, 10**30, 3])
def test_generation_config_eos_outside_the_vocab_names_the_file(tmp_path, eos):
    """A tokenizer without eos_token falls back to generation_config.json's eos_token_id;
    one outside the vocab is a ConfigError naming the file, not an OverflowError."""
    from rl_jax.knobs import ConfigError

    d = _word_tokenizer_dir(tmp_path, {})
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id=.* in \[0, 3\)"):
        HFTokenizer.from_dir(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert HFTokenizer.from_dir(d).eos_id == 0


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_weight_of_an_integer_or_bool_dtype_is_refused(hf_dirs, tmp_path, dtype):
    """A weight stored as ints or bools (a damaged or foreign file) is a CheckpointError
    naming the tensor and its dtype, not cast to floats and loaded."""
    d, _ = hf_dirs["llama"]
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    tensors = {k: np.array(v) for k, v in open_safetensors(bad / "model.safetensors").items()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(dtype)
    write_safetensors(bad / "model.safetensors", tensors)
    name = np.dtype(dtype).name
    with pytest.raises(CheckpointError, match=f"'model.norm.weight' has dtype {name}; weights"):
        load_hf(bad)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"vocab_size": -64}, r"model.vocab_size=-64 must be > 0"),
        ({"num_key_value_heads": 3}, r"model.num_heads=4 must be a multiple of model.num_kv"),
        ({"num_attention_heads": 5, "head_dim": None}, r"model.hidden_size=32 is not divisible"),
    ],
)
def test_invalid_checkpoint_dimensions_name_the_directory(hf_dirs, tmp_path, change, match):
    """Dimensions in config.json that make no valid spec name the checkpoint, not only the
    model.* field the user never set."""
    d, _ = hf_dirs["llama"]
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    from rl_jax.knobs import ConfigError

    with pytest.raises(ConfigError, match=f"^HF directory {bad}: {match}"):
        resolve_spec(ModelConfig(path=str(bad)))


def test_a_tensor_stored_in_two_shards_is_refused(hf_dirs, tmp_path):
    """A sharded checkpoint holding one tensor twice (a stray or mixed-up shard) is a
    CheckpointError naming both files, not the later file's copy loaded silently."""
    out = export_hf(load_hf(hf_dirs["llama"][0]), tmp_path / "sharded", max_shard_bytes=8_000)
    shards = sorted(out.glob("model-*.safetensors"))
    last = {k: np.array(v) for k, v in open_safetensors(shards[-1]).items()}
    last["model.embed_tokens.weight"] = np.zeros_like(
        open_safetensors(shards[0])["model.embed_tokens.weight"]
    )
    write_safetensors(shards[-1], last)
    with pytest.raises(
        CheckpointError,
        match=f"'model.embed_tokens.weight' is in both {shards[0].name} and {shards[-1].name}",
    ):
        load_hf(out)
