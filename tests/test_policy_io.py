"""A trained policy out of its run: rl-jax eval, sample and convert on a run's checkpoints."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from rl_jax.config import ConfigError, load_recipe
from rl_jax.models import CheckpointError, load_model, model_params
from rl_jax.runs import read_jsonl
from rl_jax.train.loop import RLTrainer
from rl_jax.train.policy_io import find_run_checkpoint, is_run_path, load_run_model

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402  (registers the test_even_first verifier)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step tiny run evaluated and checkpointed at steps 2 and 4; its final params."""
    out = tmp_path_factory.mktemp("runs")
    cfg = load_recipe(
        "scalerl",
        [
            *train_even_first.TINY_RUN,
            "train.steps=4",
            "eval.every=2",
            "eval.at_start=false",
            "checkpoint.every=2",
            "checkpoint.keep=3",
            f"out_dir={out}",
            "name=r",
        ],
    )
    tr = RLTrainer(cfg, quiet=True)
    tr.run_loop()
    params = {k: np.asarray(jax.device_get(v)) for k, v in tr.params.items()}
    return Path(tr.run.root), params


def _eval(capsys, *argv):
    from rl_jax.cli import eval as eval_cli

    assert eval_cli.main([*map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_reproduces_the_runs_own_curve_rows(run, capsys):
    path, _ = run
    rows = {r["step"]: r for r in read_jsonl(path / "curve.jsonl")}
    assert sorted(rows) == [2, 4]
    keys = ["val/pass@1", "val/best@k", "val/worst@k", "val/response_len", "val/truncation_rate"]
    for step, where in ((4, [path]), (2, [path, "--step", 2]), (2, [path / "checkpoints" / "2"])):
        got = _eval(capsys, *where)
        assert got["step"] == step and got["version"] == rows[step]["version"]
        assert {k: got[k] for k in keys} == {k: rows[step][k] for k in keys}, step
        assert got["counters"]["rollouts"] == rows[step]["rollouts"]
    # Eval settings are overrides; the run directory is only read.
    before = (path / "curve.jsonl").read_text()
    got = _eval(capsys, path, "eval.k=3", "eval.num_prompts=4")
    assert got["val/k"] == 3.0 and got["eval"]["eval.num_prompts"] == 4
    assert (path / "curve.jsonl").read_text() == before


def test_bad_runs_and_overrides_name_the_problem(run, tmp_path):
    from rl_jax.cli import eval as eval_cli

    path, _ = run
    with pytest.raises(ConfigError, match=r"no checkpoint at step 3; saved steps: \[2, 4\]"):
        eval_cli.main([str(path), "--step", "3"])
    with pytest.raises(ConfigError, match="names step 2 but step=4"):
        find_run_checkpoint(path / "checkpoints" / "2", 4)
    with pytest.raises(ConfigError, match="they define the policy"):
        eval_cli.main([str(path), "train.lr=1.0"])
    with pytest.raises(ConfigError, match="not a run directory"):
        eval_cli.main([str(tmp_path)])
    assert is_run_path(path) and is_run_path(path / "checkpoints" / "4")
    assert not is_run_path(tmp_path)
    # An HF model directory with a checkpoints folder is still a model, not a run.
    hf = tmp_path / "hf_model"
    (hf / "checkpoints").mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not is_run_path(hf) and not is_run_path(hf / "checkpoints")


def test_a_damaged_checkpoint_names_the_tensor(run, tmp_path):
    import shutil

    path, _ = run
    copy = tmp_path / "r"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["config"]["model"]["hidden_size"] = 32  # a run whose config no longer fits its weights
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"params/embed has shape \(64, 64\)"):
        load_run_model(copy)
    shutil.copy(path / "config.json", copy / "config.json")
    for f in (copy / "checkpoints" / "4" / "state").iterdir():
        if f.is_file():
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"checkpoints/4/state"):
        load_run_model(copy, step=4)


def test_load_sample_and_convert_a_runs_policy(run, tmp_path, capsys):
    from rl_jax.cli import convert as convert_cli
    from rl_jax.cli import sample as sample_cli
    from rl_jax.data.tokenizer import CharTokenizer
    from rl_jax.models.tokenizer import load_tokenizer

    path, final = run
    model, ck = load_run_model(path)
    assert ck.step == 4
    got = {k: np.asarray(v) for k, v in model_params(model).items()}
    assert got.keys() == final.keys()
    for k in final:
        np.testing.assert_array_equal(got[k], final[k], err_msg=k)

    argv = ["--model", str(path), "--prompt", "12+34=", "--json", "sampling.n=2"]
    assert sample_cli.main(argv) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert len(rows) == 2 and all(len(r["logprobs"]) == r["length"] for r in rows)
    with pytest.raises(ConfigError, match="--step needs a run"):
        sample_cli.main(["--model", str(tmp_path), "--step", "2", "--prompt", "1"])

    # Run -> HF directory with the character tokenizer as an HF tokenizer of the same ids.
    out = tmp_path / "hf"
    assert convert_cli.main([str(path), str(out), "--step", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["from"] == "run" and summary["step"] == 2 and summary["to"] == "hf"
    step2, _ = load_run_model(path, step=2)
    hf = model_params(load_model(str(out)))
    for k, v in model_params(step2).items():
        np.testing.assert_array_equal(np.asarray(hf[k]), np.asarray(v), err_msg=k)
    tok, char = load_tokenizer(out), CharTokenizer()
    for text in ["12+34=", "Hello World? <answer>7</answer>", "\u00e9Z\n\t x;"]:
        assert tok.encode(text) == char.encode(text), text
    assert tok.eos_id == char.eos_id and tok.pad_id == char.pad_id


def flip_bytes(step_dir: Path, array: np.ndarray, n: int = 7) -> Path:
    """Flip `n` bytes inside `array`'s stored bits in a checkpoint (found by its contents:
    the checkpoints are uncompressed), as a disk or a copy might; returns the file."""
    needle = array.tobytes()[:16]  # the first elements of its first shard
    for f in sorted((step_dir / "state").rglob("*")):
        data = bytearray(f.read_bytes()) if f.is_file() else b""
        at = data.find(needle)
        if at >= 0:
            for i in range(n):
                data[at + 8 + 3 * i] ^= 0x5A
            f.write_bytes(bytes(data))
            return f
    raise AssertionError(f"the array's bytes are not in {step_dir}")


@pytest.fixture
def damaged_run(run, tmp_path):
    """A copy of the run whose step-4 params/embed has 7 bytes flipped."""
    import shutil

    path, _ = run
    copy = tmp_path / "r"
    shutil.copytree(path, copy)
    model, _ = load_run_model(path, step=4)
    flip_bytes(copy / "checkpoints" / "4", np.asarray(model_params(model)["embed"]))
    return copy


def test_a_damaged_step_asked_for_is_refused_naming_the_array(damaged_run, tmp_path, capsys):
    from rl_jax.cli import main

    for argv in (
        ["convert", damaged_run, tmp_path / "hf", "--step", "4"],
        ["convert", damaged_run / "checkpoints" / "4", tmp_path / "hf"],
        ["eval", damaged_run, "--step", "4"],
        ["sample", "--model", damaged_run, "--step", "4", "--prompt", "1+2="],
    ):
        assert main(list(map(str, argv))) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert "checkpoints/4" in err and "array params/embed does not match" in err, err
    assert not (tmp_path / "hf").exists()
    # score reads models, not runs: it says how to get one.
    assert main(["score", "--model", str(damaged_run), "--token-ids", "5,6"]) == 2
    assert "rl-jax convert" in capsys.readouterr().err


def test_the_newest_damaged_step_falls_back_to_the_previous_verified_one(
    run, damaged_run, tmp_path, capsys
):
    from rl_jax.cli import main

    path, _ = run
    assert main(["convert", str(damaged_run), str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["step"] == 2
    assert "checkpoints/4" in err and "params/embed" in err and "using step 2" in err, err
    step2, _ = load_run_model(path, step=2)
    hf = model_params(load_model(str(tmp_path / "hf")))
    np.testing.assert_array_equal(np.asarray(hf["embed"]), np.asarray(model_params(step2)["embed"]))
    assert main(["eval", str(damaged_run), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["step"] == 2
    assert "using step 2" in err, err
    # The run directory is only read: the damaged checkpoint stays where it is.
    assert (damaged_run / "checkpoints" / "4" / "state").is_dir()
