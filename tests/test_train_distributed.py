"""Two local processes under jax.distributed (gloo) run two RL steps into a bucket (the GCS
server of conftest's `gcs` fixture) and match one process on a local disk."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_jax.runs import open_store, read_jsonl

WORKER = Path(__file__).parent / "_workers" / "distributed_train.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, gcs):
    port = str(_free_port())
    bucket_out = f"{gcs.base}/runs"
    # Output to files, not pipes: nobody reads a pipe while the reference run below
    # goes on, and a worker blocked writing to a full one never reaches jax.distributed's
    # shutdown barrier (the other then fails it after 5 minutes).
    logs = [open(tmp_path / f"worker_{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), port, str(tmp_path), bucket_out],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, log in enumerate(logs)
    ]
    single = subprocess.run(
        [sys.executable, str(WORKER), "-1", "0", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    for p in procs:
        p.wait(timeout=600)
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "OK 2 4" in out
    assert single.returncode == 0, single.stderr[-3000:]
    multi = np.load(tmp_path / "params_0.npz")
    other = np.load(tmp_path / "params_1.npz")
    ref = np.load(tmp_path / "params_-1.npz")
    for k in ref.files:
        np.testing.assert_array_equal(multi[k], other[k], err_msg=k)
        np.testing.assert_allclose(multi[k], ref[k], atol=1e-5, rtol=1e-5, err_msg=k)
    # the two steps really trained (not a vacuous comparison of untouched weights)
    run = open_store(f"{bucket_out}/dist")
    done = json.loads(run.read_bytes("DONE"))
    assert done["version"] == 2
    rows = read_jsonl(f"{bucket_out}/dist/metrics.jsonl")
    assert sum(r.get("train/rows_trained", 0) for r in rows) > 0
    # One process wrote the rows (none twice); orbax wrote each process's shards.
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    names = gcs.objects(gcs.bucket, "runs/dist/checkpoints/2/state/")
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= {n.split("/")[5] for n in names}
