"""Run and grid directories in a bucket, against a real GCS server (fake-gcs-server, started
by the `gcs` fixture in conftest.py): locks, rows, resume on a machine with no local
state, a server outage, a grid whose driver and runs are killed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_jax.config import RunConfig
from rl_jax.runs import RunDirError, StorageError, create_run_dir, locks, read_jsonl
from rl_jax.runs.storage import open_store, retrying

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "_workers"
sys.path.insert(0, str(WORKERS))

from gcs_emulator import Proxy  # noqa: E402
from train_even_first import TINY_RUN  # noqa: E402

TRAIN = [sys.executable, str(WORKERS / "train_even_first.py"), "train", "scalerl"]
# 6 steps, evaluated and checkpointed every 2: the run the resume tests compare.
RUN = [*TINY_RUN, "train.steps=6", "eval.every=2", "checkpoint.every=2", "--quiet"]
DROP = ("time/", "device_seconds", "eval_device_seconds")


def comparable(rows: list[dict]) -> list[dict]:
    """Rows less wall-clock timings and where the run was written."""
    return [
        {k: v for k, v in r.items() if not k.startswith(DROP) and k not in (*DROP, "out_dir")}
        for r in rows
    ]


def fresh_machine(tmp_path: Path, name: str, env: dict) -> dict:
    """The environment of a machine with nothing of the run on it: its own HOME and caches
    (the compilation cache and the built CPU kernels are shared: they hold programs, no
    run state; building the kernels anew costs each machine ~20 s)."""
    from rl_jax.kernels.cpu import kernel_cache_dir

    home = tmp_path / name
    home.mkdir()
    kernels = {"RL_JAX_KERNEL_CACHE": str(kernel_cache_dir())}
    return {**env, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), **kernels}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 6-step tiny run on a local disk, never interrupted."""
    out = tmp_path_factory.mktemp("reference")
    r = subprocess.run(
        [*TRAIN, *RUN, f"out_dir={out}", "name=r"], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {n: comparable(read_jsonl(out / "r" / n)) for n in ("metrics.jsonl", "curve.jsonl")}


def rows_in(url: str) -> dict[str, list[dict]]:
    return {n: comparable(read_jsonl(f"{url}/{n}")) for n in ("metrics.jsonl", "curve.jsonl")}


# ---- locks ------------------------------------------------------------------------------


def test_a_lease_refuses_a_second_holder_names_it_and_is_taken_over_once_expired(gcs, capsys):
    url = f"{gcs.base}/runs/r/.lock"
    first = locks.LeaseLock(url, what="run r", lease=60)
    with pytest.raises(locks.LockBusy, match=r"run r is in use by another process \(host .*, pid"):
        locks.LeaseLock(url, what="run r", lease=60)
    assert locks.lease_holder(url)["token"] == first.holder["token"]
    first._stop.set()  # its process "dies": nobody renews the lease any more
    first._thread.join()
    # The lease ran out (as if 61 s went by without a renewal): a new launch takes over.
    body = json.loads(open_store(gcs.base).read_bytes("runs/r/.lock"))
    open_store(gcs.base).write("runs/r/.lock", json.dumps({**body, "renewed": 0}).encode())
    second = locks.LeaseLock(url, what="run r", lease=60)
    assert "took over the lock" in capsys.readouterr().err
    # The first holder, back from the dead, finds its lock gone and writes nothing more.
    first._thread = None
    with pytest.raises(Exception, match="412|Precondition|PreconditionFailed"):
        first._renew()
    second.release()
    assert locks.lease_holder(url) is None
    assert not open_store(gcs.base).exists("runs/r/.lock")


def test_a_holder_that_loses_its_lease_stops_writing(gcs):
    url = f"{gcs.base}/runs/r/.lock"
    lock = locks.LeaseLock(url, what="run r", lease=60)
    lock._lose("the lock object was replaced")
    with pytest.raises(StorageError, match="lost the lock"):
        lock.check()
    lock.release()


def _raise(e: Exception):
    def fail():
        raise e

    return fail


def test_storage_retries_transient_failures_then_names_what_failed():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection refused")
        return "ok"

    assert retrying("writing gs://b/x", flaky, deadline_s=60) == "ok" and len(calls) == 3
    with pytest.raises(StorageError, match=r"writing gs://b/x failed after \d+ tries"):
        retrying(
            "writing gs://b/x", lambda: (_ for _ in ()).throw(TimeoutError("slow")), deadline_s=0.1
        )
    with pytest.raises(FileNotFoundError):  # not transient: no retry
        retrying("reading gs://b/x", _raise(FileNotFoundError("x")))


# ---- rows -------------------------------------------------------------------------------


def test_bucket_rows_are_uploaded_whole_when_flushed(gcs):
    cfg = RunConfig(out_dir=f"{gcs.base}/runs", name="r")
    rd = create_run_dir(cfg)
    rd.rewind(-1)
    rd.append_metrics({"step": 1, "x": 1.0})
    rd.append_metrics({"step": 2, "x": 2.0})
    # Buffered: the bucket has no metrics.jsonl until a flush (a kill here loses rows after
    # the newest checkpoint only, which a resume writes again).
    assert not open_store(rd.url()).exists("metrics.jsonl")
    rd.flush()
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2]
    assert rd.row_counts()["metrics.jsonl"] == 2
    rd.close()
    again = create_run_dir(cfg)
    again.rewind(1, {"metrics.jsonl": 1, "curve.jsonl": 0, "samples.jsonl": 0})
    assert [r["step"] for r in read_jsonl(again.metrics_path)] == [1]
    again.close()


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_damaged_logs_are_repaired_after_the_checkpoint_and_refused_before_it(
    where, tmp_path, request
):
    base = str(tmp_path) if where == "local" else request.getfixturevalue("gcs").base + "/runs"
    rd = create_run_dir(RunConfig(out_dir=base, name="r"))
    store = rd.store
    rows = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 7)).encode()
    expected = {"metrics.jsonl": 4, "curve.jsonl": 0, "samples.jsonl": 0}
    # Garbage after the rows (bytes appended, a torn last line): cut.
    store.write("metrics.jsonl", rows + b"\xff\xfe\xfd")
    rd.rewind(4, expected)
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2, 3, 4]
    # A bad line after the checkpoint's rows: dropped with them.
    store.write("metrics.jsonl", rows[:40] + b"{bad\n" + rows[40:])
    rd.rewind(2, {**expected, "metrics.jsonl": 2})
    assert [r["step"] for r in read_jsonl(rd.metrics_path)] == [1, 2]
    # A bad line among the rows the checkpoint needs: refused, naming file and line.
    store.write("metrics.jsonl", rows[:13] + b"\xff\xfe\xfd\n" + rows[13:])
    with pytest.raises(RunDirError, match=r"metrics\.jsonl: line 2 is not UTF-8"):
        rd.rewind(4, expected)
    # Rows that went missing (an emptied file, a deleted one): refused, naming the file.
    store.write("metrics.jsonl", b"")
    with pytest.raises(RunDirError, match=r"metrics\.jsonl holds 0 rows up to step 4.*recorded 4"):
        rd.rewind(4, expected)
    store.remove("metrics.jsonl")
    with pytest.raises(RunDirError, match="rows are missing"):
        rd.rewind(4, expected)
    rd.close()


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_run_directory_named_for_a_first_version_id_is_found_and_taken_up(
    where, tmp_path, request, monkeypatch, capsys
):
    """A run directory named for its run id (a grid's, the demo's) made before ids had
    versions: found from the name today's id gives it, and taken up under today's id."""
    import dataclasses

    from legacy_ids import legacy_run_id, use_legacy_ids

    from rl_jax.config import run_id
    from rl_jax.runs.run_dir import find_run_dirs

    base = str(tmp_path) if where == "local" else request.getfixturevalue("gcs").base + "/runs"
    cfg = RunConfig(out_dir=base)
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1))
    with monkeypatch.context() as m:
        use_legacy_ids(m, modules=("rl_jax.runs.run_dir",))
        for c in (cfg, other):  # the run, and a run of another config beside it
            rd = create_run_dir(dataclasses.replace(c, name=f"demo-{legacy_run_id(c)}"))
            rd.rewind(-1)
            rd.append_curve({"run_id": rd.run_id, "step": 0})
            rd.mark_done({"run_id": rd.run_id, "steps": 0})
            rd.close()
    old_id, new_id = legacy_run_id(cfg), run_id(cfg)
    store = open_store(base)
    # Siblings not named for an earlier id, or whose config does not parse: passed over.
    store.write("demo-notanid/config.json", b"{")
    store.write(f"demo-{legacy_run_id(other)}x/config.json", b"{")
    name, name_other = f"demo-{new_id}", f"demo-{run_id(other)}"
    found = find_run_dirs(base, [(name, new_id), (name_other, run_id(other))])
    assert found == {name: f"demo-{old_id}", name_other: f"demo-{legacy_run_id(other)}"}
    assert find_run_dirs(base, [(f"other-{new_id}", new_id)]) == {}
    capsys.readouterr()
    rd = create_run_dir(dataclasses.replace(cfg, name=found[name]))
    assert f"under its run id {old_id} of an earlier id version" in capsys.readouterr().err
    assert rd.run_id == new_id and rd.continued_from() == [old_id]
    assert [r["run_id"] for r in rd.curve()] == [new_id] and rd.read_done()["run_id"] == new_id
    rd.close()
    # Taken up, it is found by its config's id without loading the config again.
    assert find_run_dirs(base, [(name, new_id)]) == {name: f"demo-{old_id}"}


def test_an_out_dir_on_storage_without_a_lock_is_refused_before_any_work(tmp_path):
    r = subprocess.run(
        [*TRAIN, *RUN, "out_dir=s3://bkt/runs"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "out_dir='s3://bkt/runs'" in r.stderr and "gs://" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- whole runs -------------------------------------------------------------------------


def wait_for(cond, proc, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_bucket_run_killed_on_one_machine_finishes_on_another_with_identical_rows(
    gcs, tmp_path, reference
):
    url = f"{gcs.base}/runs/r"
    cmd = [*TRAIN, *RUN, f"out_dir={gcs.base}/runs", "name=r"]
    host_a = fresh_machine(tmp_path, "a", dict(os.environ))
    a = subprocess.Popen(cmd, env=host_a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    committed = "runs/r/checkpoints/2/commit_success.txt"
    wait_for(lambda: committed in gcs.objects(gcs.bucket, "runs/r/"), a, "checkpoint 2")
    a.send_signal(signal.SIGKILL)
    a.wait()
    # Host A's VM is deleted with its disk; its lease is left behind, and runs out.
    body = json.loads(open_store(url).read_bytes(".lock"))
    open_store(url).write(".lock", json.dumps({**body, "renewed": 0}).encode())
    host_b = fresh_machine(tmp_path, "b", dict(os.environ))
    b = subprocess.run(cmd, env=host_b, capture_output=True, text=True, timeout=900)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "took over the lock" in b.stderr and "resuming from step " in b.stderr
    assert rows_in(url) == reference
    names = gcs.objects(gcs.bucket, "runs/r/")
    assert "runs/r/DONE" in names and "runs/r/plots/curve.png" in names
    assert not any("/.lock" in n for n in names)  # released at the end
    # The run is read where it is: eval restores (and verifies) its checkpoint there.
    cli = [sys.executable, str(WORKERS / "train_even_first.py")]
    ev = subprocess.run([*cli, "eval", url, "--json"], capture_output=True, text=True)
    assert ev.returncode == 0, ev.stderr[-3000:]
    got = json.loads(ev.stdout.strip().splitlines()[-1])
    last = read_jsonl(f"{url}/curve.jsonl")[-1]
    assert got["step"] == 6 and got["val/pass@1"] == last["val/pass@1"]
    # The fitting library reads curves there too (a file, or every curve below a URL).
    from rl_jax.scaling import load_rows

    assert len(load_rows(f"{url}/curve.jsonl")) == len(load_rows(gcs.base)) == 4


def test_a_bucket_run_rides_out_a_server_outage(gcs, tmp_path, reference):
    """The server stops mid-run (every request fails) and comes back: the run retries,
    then finishes with the rows of a run that never saw the outage."""
    proxy = Proxy(gcs.port)
    env = {**os.environ, **gcs.env(proxy.port)}
    url = f"{gcs.base}/runs/r"
    cmd = [*TRAIN, *RUN, f"out_dir={gcs.base}/runs", "name=r"]
    run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "runs/r/curve.jsonl" in gcs.objects(gcs.bucket, "runs/r/"), run, "a row")
        gcs.stop()
        proxy.wait_failures(2)  # the run met the outage (and is retrying)
        gcs.start()
        out, err = run.communicate(timeout=900)
        assert run.returncode == 0, err[-3000:]
        assert rows_in(url) == reference
    finally:
        if run.poll() is None:
            run.kill()
        proxy.close()
        if gcs.proc is None:
            gcs.start()


# ---- grids ------------------------------------------------------------------------------


def test_a_grid_in_a_bucket_survives_its_driver_and_runs_being_killed(gcs, tmp_path):
    import psutil
    from test_grid_driver import FAKE, curves, ledger_counts, run_grid, write_spec

    spec = write_spec(tmp_path)
    assert run_grid(spec, tmp_path / "local", "--jobs", "2", "--no-report") == 0
    reference = curves(tmp_path / "local")
    out = f"{gcs.base}/grids"
    ledger = tmp_path / "ledger"
    tag = f"bucket-grid-{os.getpid()}"
    env = {
        **os.environ,
        "FAKE_LEDGER": str(ledger),
        "FAKE_SLEEP": "0.02",
        "RL_JAX_LEASE_S": "2",  # a killed run's locks run out quickly
        "RL_JAX_TEST_TAG": tag,
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [sys.executable, "-m", "rl_jax.cli", "grid", str(spec), "--out", out]
    cmd += ["--train-cmd", FAKE, "--jobs", "2", "--poll", "0.05", "--no-report"]
    driver = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    while not (ledger.exists() and ledger.read_text().count(" start ") >= 2):
        assert driver.poll() is None, "the driver ended before two runs started"
        time.sleep(0.05)
    # The driver's machine goes away: the driver and every run it started, at once.
    for p in psutil.process_iter():
        try:
            if p.environ().get("RL_JAX_TEST_TAG") == tag:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    driver.wait()
    rerun = subprocess.run(
        cmd, env={**env, "RL_JAX_TEST_TAG": ""}, cwd=ROOT, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    runs = open_store(f"{out}/tiny/runs")
    got = {
        name: [
            {k: v for k, v in r.items() if k != "out_dir"}
            for r in read_jsonl(f"{out}/tiny/runs/{name}/curve.jsonl")
        ]
        for name in runs.list()
    }
    assert got == reference
    counts = ledger_counts(ledger)
    assert all(c["done"] == 1 for c in counts.values()) and len(counts) == 4
    state = json.loads(open_store(f"{out}/tiny").read_bytes("state.json"))
    assert all(r["status"] == "done" for r in state["runs"].values())
    # The attempts' logs are in the bucket beside the runs.
    assert any(n.endswith(".log") for n in gcs.objects(gcs.bucket, "grids/tiny/logs/"))
    # A second driver on the busy grid is refused, naming the first (exit 2).
    held = locks.LeaseLock(f"{out}/tiny/driver.lock", what="grid", lease=60)
    try:
        busy = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        assert busy.returncode == 2 and "in use by another process" in busy.stderr
    finally:
        held.release()
