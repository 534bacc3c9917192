"""A run stopped at any moment and rerun writes exactly the rows of one that never stopped.

Crashes are raised from a step hook (after a step's metrics row, before its
evaluation and checkpoint); kills with SIGKILL are in test_train_loop.py and
benchmarks/resume_check.py.
"""

import json
import sys
from pathlib import Path

import pytest

from rl_jax.config import load_recipe
from rl_jax.runs import read_jsonl
from rl_jax.train.loop import RLTrainer

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import train_even_first  # noqa: E402

BASE = [*train_even_first.TINY_RUN, "eval.every=2", "checkpoint.async_save=false"]
PPO = [
    "train.steps=8",
    "train.off_policy=ppo_off_policy",
    "train.off_policy_k=2",
    "checkpoint.every=3",
    "checkpoint.keep=2",
]


def _trainer(tmp_path, name, *extra):
    cfg = load_recipe("scalerl", [*BASE, f"out_dir={tmp_path}", f"name={name}", *extra])
    return RLTrainer(cfg, quiet=True)


def _run(tmp_path, name, *extra, crash_at=None):
    return train_even_first.run_loop(_trainer(tmp_path, name, *extra), crash_at)


def _rows(run_dir: Path):
    drop = ("time/", "device_seconds", "eval_device_seconds")
    return {
        name: [
            {
                k: v
                for k, v in r.items()
                if not k.startswith(drop) and k not in (*drop, "name", "out_dir")
            }
            for r in read_jsonl(run_dir / name)
        ]
        for name in ("metrics.jsonl", "curve.jsonl")
    }


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    _run(root, "ref", *PPO)
    return _rows(root / "ref")


def test_crash_before_the_first_checkpoint_writes_no_row_twice(tmp_path):
    extra = ("train.steps=4", "checkpoint.every=0")
    _run(tmp_path, "ref", *extra)
    first = _run(tmp_path, "crash", *extra, crash_at=3)
    assert first.ckpt.steps() == []
    assert [r["step"] for r in read_jsonl(tmp_path / "crash" / "curve.jsonl")] == [0, 2]
    _run(tmp_path, "crash", *extra)
    got = _rows(tmp_path / "crash")
    assert [r["step"] for r in got["curve.jsonl"]] == [0, 2, 4]
    assert got == _rows(tmp_path / "ref")
    # A DONE file cut short (a damaged disk) finishes the run again instead of a traceback.
    done = tmp_path / "crash" / "DONE"
    done.write_text(done.read_text()[:9])
    summary = _trainer(tmp_path, "crash", *extra).run_loop()
    assert summary["steps"] == 4 and json.loads(done.read_text())["steps"] == 4
    assert _rows(tmp_path / "crash") == got


def test_ppo_off_policy_checkpoints_only_between_groups(tmp_path, ppo_reference):
    # checkpoint.every=3 falls inside the group of steps 3-4 (k=2): it is taken at 4.
    first = _run(tmp_path, "ppo", *PPO, crash_at=5)
    assert first.ckpt.steps() == [4]
    _run(tmp_path, "ppo", *PPO)
    assert _rows(tmp_path / "ppo") == ppo_reference


def test_silently_damaged_checkpoint_is_detected_and_set_aside(tmp_path, ppo_reference):
    first = _run(tmp_path, "dmg", *PPO, crash_at=7)
    assert first.ckpt.steps() == [4, 6]
    # Overwrite bytes inside the largest array file of the newest checkpoint: orbax
    # restores such a file without an error (the weights are incompressible).
    files = [f for f in (tmp_path / "dmg" / "checkpoints" / "6").rglob("*") if f.is_file()]
    big = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(range(64))
    big.write_bytes(bytes(data))
    again = _run(tmp_path, "dmg", *PPO)
    assert _rows(tmp_path / "dmg") == ppo_reference  # resumed from 4, not from 6
    assert [
        p.name.split("-")[0] for p in (tmp_path / "dmg" / "checkpoints.unusable").iterdir()
    ] == ["6"]
    assert again.ckpt.steps() == [6, 8]


def test_pipeline_drains_at_checkpoints_and_resumes_exactly(tmp_path):
    # PipelineRL's stream on the engine admits no group past the next checkpoint, so
    # nothing is in flight there: a crash after step 3 resumes from step 2's checkpoint
    # and writes the rows of the run that never stopped.
    extra = (
        "train.steps=4",
        "train.off_policy=pipeline",
        "train.off_policy_k=2",
        "sampling.decode_chunk=2",
        "checkpoint.every=2",
    )
    _run(tmp_path, "ref", *extra)
    first = _run(tmp_path, "pipe", *extra, crash_at=3)
    assert first.ckpt.steps() == [2]
    again = _run(tmp_path, "pipe", *extra)
    assert _rows(tmp_path / "pipe") == _rows(tmp_path / "ref")
    assert not again.in_flight and again.ckpt.steps() == [2, 4]


def test_a_run_made_under_first_version_ids_resumes_exactly(
    tmp_path, monkeypatch, capsys, ppo_reference
):
    """A run directory made before run ids had versions (config.json, rows and checkpoints
    under a 12-hex-digit id) is taken up by the same command and finishes with the rows of
    a run that never stopped, its id the one today's command gives it."""
    from legacy_ids import use_legacy_ids

    from rl_jax.config import id_version, run_id
    from rl_jax.runs import RunDirError

    with monkeypatch.context() as m:
        use_legacy_ids(m)
        first = _run(tmp_path, "old", *PPO, crash_at=5)
    config = tmp_path / "old" / "config.json"
    old_id = json.loads(config.read_text())["run_id"]
    assert id_version(old_id) == 1 and first.ckpt.steps() == [4]
    assert {r["run_id"] for r in read_jsonl(tmp_path / "old" / "curve.jsonl")} == {old_id}
    # Another config is refused as before, whatever the id version.
    with pytest.raises(RunDirError, match=f"holds run {old_id} with another config"):
        _trainer(tmp_path, "old", *PPO, "train.seed=1")
    capsys.readouterr()
    again = _run(tmp_path, "old", *PPO)  # resumes from step 4's checkpoint (old_id's)
    assert f"under its run id {old_id} of an earlier id version" in capsys.readouterr().err
    assert again.run_id == run_id(again.cfg) != old_id
    assert _rows(tmp_path / "old") == ppo_reference
    doc = json.loads(config.read_text())
    assert doc["run_id"] == again.run_id and doc["continued_from"] == [old_id]
    assert json.loads((tmp_path / "old" / "DONE").read_text())["run_id"] == again.run_id
