"""The reliability pass's defects, each reproduced: starting over (checkpoint.resume=false),
a background save that fails, damaged logs, config errors that would leave a half-made
run directory, and a second grid driver."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from rl_jax.cli import main as cli
from rl_jax.config import load_recipe
from rl_jax.knobs import ConfigError
from rl_jax.runs import RunDirError, StorageError, read_jsonl
from rl_jax.train.loop import RLTrainer

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

BASE = [
    *train_even_first.TINY_RUN,
    "train.steps=6",
    "eval.every=2",
    "checkpoint.every=2",
    "checkpoint.async_save=false",
]


def _trainer(out, name="r", *extra) -> RLTrainer:
    return RLTrainer(load_recipe("scalerl", [*BASE, f"out_dir={out}", f"name={name}", *extra]))


def _run(out, name="r", *extra, crash_at=None) -> RLTrainer:
    return train_even_first.run_loop(_trainer(out, name, *extra), crash_at)


def _rows(run: Path) -> dict[str, list[dict]]:
    """Rows less timings and the knobs of where and how the run was launched (the knobs of
    a row record the launch that wrote it)."""
    drop = ("time/", "device_seconds", "eval_device_seconds")
    launch = ("name", "out_dir", "checkpoint.resume", "checkpoint.async_save")
    return {
        n: [
            {k: v for k, v in r.items() if not k.startswith(drop) and k not in (*drop, *launch)}
            for r in read_jsonl(run / n)
        ]
        for n in ("metrics.jsonl", "curve.jsonl")
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    _run(out)
    return _rows(out / "r")


def test_resume_false_starts_over_and_a_later_rerun_has_no_gap(tmp_path, reference):
    """Killed after checkpoint 4, rerun with resume=false (which must save its own step 2,
    not skip it because the old trajectory has a later one), killed after step 2, rerun
    plainly: the rows are a whole run's, none missing."""
    _run(tmp_path, crash_at=5)
    _run(tmp_path, "r", "checkpoint.resume=false", crash_at=3)
    aside = [p.name for p in tmp_path.joinpath("r").iterdir() if p.name.startswith("discarded-")]
    assert len(aside) == 1
    assert sorted(p.name for p in (tmp_path / "r" / aside[0] / "checkpoints").iterdir()) == [
        "2",
        "4",
    ]
    again = _run(tmp_path)
    assert again.ckpt.steps()[-1] == 6
    assert _rows(tmp_path / "r") == reference


def test_resume_false_on_a_finished_run_trains_it_again(tmp_path, reference):
    _run(tmp_path)
    again = _run(tmp_path, "r", "checkpoint.resume=false")
    assert again.version == 6  # trained, not returned at once on DONE
    assert _rows(tmp_path / "r") == reference
    assert (tmp_path / "r" / "DONE").exists()
    aside = [p for p in (tmp_path / "r").iterdir() if p.name.startswith("discarded-")]
    assert len(aside) == 1 and (aside[0] / "DONE").exists()


def test_a_failed_background_save_stops_the_run_within_a_step_in_one_line(tmp_path):
    tr = _trainer(tmp_path, "r", "checkpoint.async_save=true")
    ckpts = tmp_path / "r" / "checkpoints"
    seen = []

    def hook(t):
        seen.append(t.step)
        if t.step == 1:  # the disk goes away under the checkpoints
            shutil.rmtree(ckpts)
            ckpts.write_text("not a directory")
        if t.step == 3:  # the step-2 save, started in the background, is over
            while t.ckpt._mngr.is_saving_in_progress():
                pass

    tr.step_hooks.append(hook)
    with pytest.raises(StorageError) as e:
        tr.run_loop()
    msg = str(e.value)
    assert "checkpoint of step 2" in msg and str(ckpts) in msg and "Not a directory" in msg
    assert "\n" not in msg
    # Stopped as step 3 or 4 began (whenever the background save had failed), not at the
    # next save: step 4 never finished.
    assert seen in ([1, 2], [1, 2, 3])


def test_unwritable_checkpoints_are_refused_before_training(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "checkpoints").write_text("x")
    rc = cli(["train", "scalerl", *BASE, f"out_dir={tmp_path}", "name=r", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "checkpoints" in err, err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_damaged_logs_are_repaired_or_refused_on_resume(tmp_path, reference):
    _run(tmp_path, crash_at=5)  # checkpoint 4, rows up to step 5
    metrics = tmp_path / "r" / "metrics.jsonl"
    with open(metrics, "ab") as f:
        f.write(b"\xff\xfe\xfd")  # bytes appended by hand
    _run(tmp_path)
    assert _rows(tmp_path / "r") == reference
    # A finished run rerun with resume=false, killed after checkpoint 4, its metrics emptied:
    # the rows up to the checkpoint cannot be rebuilt, and the rerun says so (exit 2).
    _run(tmp_path, "r", "checkpoint.resume=false", crash_at=5)
    metrics.write_bytes(b"")
    with pytest.raises(RunDirError, match=r"metrics\.jsonl holds 0 rows up to step 4"):
        _run(tmp_path)
    (tmp_path / "r" / "curve.jsonl").unlink()
    rc = cli(["train", "scalerl", *BASE, f"out_dir={tmp_path}", "name=r", "--quiet"])
    assert rc == 2


@pytest.mark.parametrize(
    "bad",
    [
        ["sampling.stop_token_ids=[99999999]"],
        ["model.num_heads=3"],
        ["mesh.data=3", "mesh.fsdp=1"],
        ["sampling.max_prompt_len=1"],
        ["model.preset=huge"],
    ],
    ids=["stop_token", "heads", "mesh", "prompt_len", "preset"],
)
def test_a_config_that_fails_to_build_leaves_no_run_directory(tmp_path, bad):
    with pytest.raises(ConfigError):
        _trainer(tmp_path, "r", *bad)
    assert not (tmp_path / "r").exists()


def test_a_prompt_longer_than_allowed_leaves_no_run_directory(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    rows[3]["question"] = "1+" * 500_000 + "1="  # a 1 MB prompt
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = ["data.source=file", f"data.path={data}"]
    rc = cli(["train", "scalerl", *BASE, *extra, f"out_dir={tmp_path}", "name=r", "--quiet"])
    assert rc == 2 and not (tmp_path / "r").exists()


def test_a_second_grid_driver_exits_2_naming_the_first(tmp_path, capsys):
    from test_grid_driver import FAKE, write_spec

    from rl_jax.runs import locks

    spec = write_spec(tmp_path)
    held = locks.acquire(tmp_path / "out" / "tiny", "driver.lock", what="grid")
    try:
        rc = cli(["grid", str(spec), "--out", str(tmp_path / "out"), "--train-cmd", FAKE])
    finally:
        held.release()
    err = capsys.readouterr().err
    assert rc == 2 and "a grid driver" in err and "in use by another process" in err, err
    assert len(err.strip().splitlines()) == 1


def test_every_shipped_recipe_checkpoints_and_grids_keep_their_end_only_runs():
    from rl_jax.config import experiments_dir
    from rl_jax.grid import expand, load_spec

    recipes = [
        p.stem
        for p in sorted(experiments_dir().glob("*.py"))
        if not p.stem.startswith("_") and "def recipe()" in p.read_text()
    ]
    assert len(recipes) >= 9, recipes
    for name in recipes:
        cfg = load_recipe(name, [])
        # A kill loses at most one interval, never the whole run.
        assert 0 < cfg.checkpoint.every < cfg.train.steps, (name, cfg.checkpoint.every)
    # A grid without checkpoints_per_run still checkpoints at the end only (its run ids
    # and PipelineRL's drains are as before the recipes checkpointed).
    spec = load_spec("scalerl_loo_cpu")
    assert spec.checkpoints_per_run == 0
    assert all(p.config.checkpoint.every == 0 for p in expand(spec))


def test_a_finished_run_continues_with_more_steps_to_the_longer_runs_rows(tmp_path, capsys):
    constant = ["train.schedule=constant", "train.warmup_steps=0.25"]
    ref = _run(tmp_path, "ref", "train.steps=8", "train.schedule=constant", "train.warmup_steps=1")
    _run(tmp_path, "r", "train.steps=4", *constant)  # warms up for 1 step
    # Rerun as it was: finished, and it says how to go on.
    _run(tmp_path, "r", "train.steps=4", *constant)
    assert "--continue" in capsys.readouterr().err
    argv = ["train", "scalerl", *BASE, f"out_dir={tmp_path}", "name=r", "--quiet", *constant]
    # A schedule that spans train.steps cannot be continued; the warm-up fraction is
    # named with the count to give.
    assert cli([*argv, "train.steps=8", "train.schedule=cosine", "--continue"]) == 2
    assert cli([*argv, "train.steps=8", "--continue"]) == 2
    assert "set train.warmup_steps=1" in capsys.readouterr().err
    assert cli([*argv, "train.steps=8", "train.warmup_steps=1", "--continue"]) == 0
    assert _rows(tmp_path / "r") == _rows(tmp_path / "ref")
    assert ref.step == 8
