import json
import multiprocessing as mp
import os
import signal
import time

import pytest

from rl_jax.config import LoggingConfig, RunConfig, apply_overrides
from rl_jax.runs import (
    MetricsLogger,
    append_jsonl,
    atomic_write_json,
    create_run_dir,
    read_jsonl,
    truncate_jsonl_after,
)


def _writer(path):
    big = {"x": "y" * 200_000}
    i = 0
    while True:
        atomic_write_json(path, {**big, "i": i})
        i += 1


def test_atomic_write_survives_sigkill(tmp_path):
    path = tmp_path / "state.json"
    atomic_write_json(path, {"i": -1})
    ctx = mp.get_context("spawn")
    for _ in range(3):
        p = ctx.Process(target=_writer, args=(str(path),))
        p.start()
        time.sleep(0.4)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        json.loads(path.read_text())  # never torn


def test_jsonl_reader_skips_torn_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, [{"step": 1}, {"step": 2}])
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    truncate_jsonl_after(path, "step", 1)
    assert [r["step"] for r in read_jsonl(path)] == [1]


def test_run_dir_layout_and_conflicts(tmp_path):
    cfg = RunConfig(out_dir=str(tmp_path), name="r")
    rd = create_run_dir(cfg)
    assert rd.root == tmp_path / "r"
    saved = json.loads(rd.config_path.read_text())
    assert saved["run_id"] == rd.run_id
    assert saved["knobs"]["loss.name"] == "cispo"
    assert create_run_dir(cfg).run_id == rd.run_id  # reopen: same config is fine
    with pytest.raises(FileExistsError, match="another config"):
        create_run_dir(apply_overrides(cfg, ["train.seed=3"]))


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
    rd = create_run_dir(RunConfig(out_dir=str(tmp_path), name="m"))
    log = MetricsLogger(rd, LoggingConfig(tensorboard=True))
    log.log(1, {"loss": 0.5, "ok": True, "text": "x"})
    log.log(2, {"loss": float("nan")})
    log.close()
    rows = rd.metrics()
    assert rows[0]["step"] == 1 and rows[0]["loss"] == 0.5
    assert any(p.name.startswith("events.out.tfevents") for p in rd.events_dir.iterdir())
