import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_jax.config import ConfigError, LoggingConfig, RunConfig, apply_overrides
from rl_jax.runs import (
    MetricsLogger,
    RunDirError,
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
    assert rd.root == str(tmp_path / "r")
    saved = json.loads(Path(rd.config_path).read_text())
    assert saved["run_id"] == rd.run_id
    assert saved["knobs"]["loss.name"] == "cispo"
    rd.close()
    again = create_run_dir(cfg)  # reopen: same config is fine
    assert again.run_id == rd.run_id
    again.close()
    with pytest.raises(RunDirError, match="another config"):
        create_run_dir(apply_overrides(cfg, ["train.seed=3"]))
    # The refusal released the lock: the right config still opens the directory.
    create_run_dir(cfg).close()


def test_append_after_a_torn_line_repairs_the_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, [{"step": 1}])
    with open(path, "a") as f:
        f.write('{"step": 2, "lo')  # a writer killed mid-line
    append_jsonl(path, [{"step": 2}, {"step": 3}])
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    path.write_text('{"step": 1')  # a torn first line: nothing whole to keep
    append_jsonl(path, [{"step": 1}])
    assert path.read_text() == '{"step": 1}\n'


_HOLD = """
import sys
from rl_jax.config import RunConfig
from rl_jax.runs import create_run_dir
rd = create_run_dir(RunConfig(out_dir=sys.argv[1], name="r"))
print("locked", flush=True)
sys.stdin.read()
"""


def test_second_process_on_a_run_is_refused_with_the_holders_pid(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = f"in use by another process \\(host .*, pid {holder.pid},"
        with pytest.raises(RunDirError, match=busy):
            create_run_dir(RunConfig(out_dir=str(tmp_path), name="r"))
        # The CLI says it in one line and exits 2 before building anything.
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "rl_jax.cli",
                "train",
                "scalerl",
                f"out_dir={tmp_path}",
                "name=r",
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"pid {holder.pid}" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    create_run_dir(RunConfig(out_dir=str(tmp_path), name="r")).close()  # free again


def test_damaged_config_json_is_rewritten_unless_rows_say_another_run(tmp_path):
    cfg = RunConfig(out_dir=str(tmp_path), name="r")
    rd = create_run_dir(cfg)
    rd.append_curve({"run_id": rd.run_id, "step": 0})
    rd.close()
    config = Path(rd.config_path)
    config.write_text('{"run_id": "ab')
    create_run_dir(cfg).close()
    assert json.loads(config.read_text())["run_id"] == rd.run_id
    config.write_text("garbage")
    with pytest.raises(RunDirError, match="another config"):
        create_run_dir(apply_overrides(cfg, ["train.seed=3"]))


def test_missing_config_json_is_judged_by_the_rows(tmp_path):
    # Without config.json, another config's run took the directory over: it wrote its own
    # config.json, read the other run's DONE and exited 0 printing that run's summary.
    cfg = RunConfig(out_dir=str(tmp_path), name="r")
    rd = create_run_dir(cfg)
    rd.append_curve({"run_id": rd.run_id, "step": 0})
    rd.mark_done({"run_id": rd.run_id, "steps": 1})
    rd.close()
    Path(rd.config_path).unlink()
    with pytest.raises(RunDirError, match="has no config.json"):
        create_run_dir(apply_overrides(cfg, ["train.seed=3"]))
    create_run_dir(cfg).close()  # its own run: config.json written again
    assert json.loads(Path(rd.config_path).read_text())["run_id"] == rd.run_id


def test_config_json_that_is_a_directory_is_refused_naming_it(tmp_path):
    # It raised IsADirectoryError from the trainer, and from `rl-jax train --continue`.
    from rl_jax.runs.run_dir import extend_run

    cfg = RunConfig(out_dir=str(tmp_path), name="r")
    create_run_dir(cfg).close()
    config = tmp_path / "r" / "config.json"
    config.unlink()
    config.mkdir()
    with pytest.raises(RunDirError, match="config.json is a directory"):
        create_run_dir(cfg)
    with pytest.raises(ConfigError, match="config.json is a directory"):
        extend_run(apply_overrides(cfg, ["train.steps=200"]))


def test_unwritable_run_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="cannot create the run directory"):
        create_run_dir(RunConfig(out_dir=str(tmp_path), name="r"), blocker / "run")


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
    rd = create_run_dir(RunConfig(out_dir=str(tmp_path), name="m"))
    log = MetricsLogger(rd, LoggingConfig(tensorboard=True))
    log.log(1, {"loss": 0.5, "ok": True, "text": "x", "val/pass@1": 0.25})
    log.log(2, {"loss": float("nan")})
    log.close()
    rows = rd.metrics()
    assert rows[0]["step"] == 1 and rows[0]["loss"] == 0.5
    events = [p for p in Path(rd.events_dir).iterdir() if p.name.startswith("events.out.tfevents")]
    scalars = {(e.step, v.tag): v.simple_value for e in _events(events[0]) for v in e.summary.value}
    # Tags as the rows name them (tensorboardX's add_scalar wrote val/pass_1).
    assert scalars == {(1, "loss"): 0.5, (1, "ok"): 1.0, (1, "val/pass@1"): 0.25}


def _events(path: Path):
    """The Event records of a TensorBoard event file (TFRecord framing: length, its CRC,
    the record, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    data, pos = path.read_bytes(), 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        yield Event.FromString(data[pos + 12 : pos + 12 + n])
        pos += 12 + n + 4


def test_tensorboard_does_not_load_torch(tmp_path):
    """tensorboardX imports torch when it can (~180 MB of resident memory); the logger's
    writer does without it, and torch still imports afterwards."""
    code = (
        "import sys; from rl_jax.runs.metrics import summary_writer_class as w; "
        f"w()({str(tmp_path)!r}).add_scalar('x', 1.0, 0); "
        "print('torch' in sys.modules); import torch; print(torch.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "torch"]


def test_a_first_version_run_continues_with_more_steps(tmp_path, monkeypatch):
    """--continue on a run directory made before run ids had versions: its rows become the
    longer run's under today's id; with as many steps it is the same run (taken up)."""
    sys.path.insert(0, str(Path(__file__).parent / "_workers"))
    from legacy_ids import legacy_run_id, use_legacy_ids

    from rl_jax.config import run_id
    from rl_jax.runs.run_dir import extend_run

    cfg = apply_overrides(RunConfig(), [f"out_dir={tmp_path}", "name=r", "train.steps=4"])
    with monkeypatch.context() as m:
        use_legacy_ids(m, modules=("rl_jax.runs.run_dir",))
        rd = create_run_dir(cfg)
        rd.rewind(-1)
        rd.append_curve({"run_id": rd.run_id, "step": 4})
        rd.mark_done({"run_id": rd.run_id})
        rd.close()
    old_id = legacy_run_id(cfg)
    assert extend_run(cfg) == 4  # the same run: nothing to continue
    assert json.loads((tmp_path / "r" / "config.json").read_text())["run_id"] == old_id
    longer = apply_overrides(cfg, ["train.steps=8"])
    assert extend_run(longer) == 4
    doc = json.loads((tmp_path / "r" / "config.json").read_text())
    assert doc["run_id"] == run_id(longer) and doc["continued_from"] == [old_id]
    assert [r["run_id"] for r in read_jsonl(tmp_path / "r" / "curve.jsonl")] == [run_id(longer)]
    assert not (tmp_path / "r" / "DONE").exists()
    with pytest.raises(ConfigError, match="differs from this config in more than train.steps"):
        extend_run(apply_overrides(longer, ["train.steps=12", "train.seed=3"]))


def test_the_demo_finds_its_run_named_for_a_first_version_id(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(Path(__file__).parent / "_workers"))
    from legacy_ids import legacy_run_id, use_legacy_ids

    from rl_jax.config import run_id
    from rl_jax.train.demo import demo_root

    cfg = apply_overrides(RunConfig(), [f"out_dir={tmp_path}", "name=demo"])
    assert demo_root(cfg) == str(tmp_path / f"demo-{run_id(cfg)}")  # nothing there yet
    old = f"demo-{legacy_run_id(cfg)}"
    with monkeypatch.context() as m:
        use_legacy_ids(m, modules=("rl_jax.runs.run_dir",))
        create_run_dir(apply_overrides(cfg, [f"name={old}"])).close()
    capsys.readouterr()
    assert demo_root(cfg) == str(tmp_path / old)
    assert f"{old} holds this run" in capsys.readouterr().err
    other = apply_overrides(cfg, ["train.seed=1"])  # another config: a directory of its own
    assert demo_root(other) == str(tmp_path / f"demo-{run_id(other)}")
