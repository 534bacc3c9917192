"""Two local processes under jax.distributed with gloo CPU collectives."""

import socket
import subprocess
import sys
from pathlib import Path

from rl_jax.kernels import cpu as _cpu_kernels

WORKER = Path(__file__).parent / "_workers" / "distributed_mesh.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_mesh_collective():
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
        # 2 processes, 4 global devices, sum of squares of 0..3 = 14
        assert line.split()[1:] == ["2", "4", "14.0"], out
    # The sampler with rows over both processes' devices: kernels (where they build) and
    # XLA attention and matmuls give the same tokens and log-probs within 1e-5, the same on both.
    sampled = [next(ln for ln in out.splitlines() if ln.startswith("SAMPLER")) for out in outs]
    for line in sampled:
        _, used, same, close, _ = line.split()
        assert used == str(_cpu_kernels.available()), line
        assert same == close == "True", line
    assert sampled[0] == sampled[1], sampled
