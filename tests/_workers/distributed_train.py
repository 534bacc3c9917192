"""Worker for test_train_distributed: RL steps under jax.distributed (2 processes, gloo).

argv: process_id port out_dir [run_out]; process_id -1 runs the single-process reference
on the same 4 devices. Writes the final parameters to <out_dir>/params_<id>.npz; the run
directory goes under run_out (a path or a gs:// URL) when given, else under out_dir.
"""

import os
import sys

from rl_jax.runtime import xla_flags_with_device_count  # imports no jax

os.environ["JAX_PLATFORMS"] = "cpu"
pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
run_out = sys.argv[4] if len(sys.argv) > 4 else out
# The session's other XLA flags (its compile settings) carry over; the device count is ours.
count = 4 if pid < 0 else 2
os.environ["XLA_FLAGS"] = xla_flags_with_device_count(os.environ.get("XLA_FLAGS", ""), count)
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import train_even_first  # noqa: E402  (registers the test verifier)
from jax.experimental import multihost_utils  # noqa: E402

from rl_jax.config import load_recipe  # noqa: E402
from rl_jax.train.loop import RLTrainer  # noqa: E402

ARGS = [
    *train_even_first.TINY_RUN,
    "eval.every=0",
    "eval.at_start=false",
    "train.steps=2",
    "mesh.data=2",
    "mesh.fsdp=-1",
]


def main() -> None:
    extra = [f"out_dir={run_out}", "name=dist" if pid >= 0 else "name=single"]
    if pid >= 0:
        extra += [
            "mesh.distributed=true",
            f"mesh.coordinator_address=127.0.0.1:{port}",
            "mesh.num_processes=2",
            f"mesh.process_id={pid}",
        ]
    cfg = load_recipe("scalerl", ARGS + extra)
    tr = RLTrainer(cfg, quiet=True)
    tr.run_loop()
    params = {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
        for k, v in tr.params.items()
    }
    np.savez(os.path.join(out, f"params_{pid}.npz"), **params)
    print("OK", jax.process_count(), jax.device_count(), flush=True)


if __name__ == "__main__":
    main()
