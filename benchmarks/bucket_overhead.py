"""Wall time of a run whose directory is in a bucket against the same run on local disk.

The demo's shapes (the `scalerl` recipe: tiny model, 16 prompts x 8 samples, PipelineRL-8),
--steps steps, evaluated and checkpointed every --every steps, run alternately into a local
directory and into a bucket on a GCS server on this machine (fake-gcs-server, the `dev`
extra), --repeats times each after one warm-up run that fills the compilation cache. Prints
one JSON line per run and a summary:

    {"local_s": [...], "bucket_s": [...], "ratio_median": 1.05, "load_avg_1m": [...]}

The server is local, so a request costs well under a millisecond where Cloud Storage's take
tens of milliseconds; a run makes a few requests per flush (every 30 s, evaluation and
checkpoint) and TensorStore's per checkpoint, so the ratio measures the work of the
storage layer, not a network's latency.

    python benchmarks/bucket_overhead.py [--steps 200] [--every 50] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "_workers"))

from _common import worker_env  # noqa: E402
from gcs_emulator import GcsEmulator  # noqa: E402


def run(out: str, name: str, steps: int, every: int, env: dict) -> float:
    cmd = [sys.executable, "-m", "rl_jax.cli", "train", "scalerl", f"out_dir={out}"]
    cmd += [f"name={name}", f"train.steps={steps}", f"eval.every={every}"]
    cmd += [f"checkpoint.every={every}", "logging.progress=false", "--quiet"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{out}/{name} failed: {r.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bucket_overhead_") as tmp:
        emu = GcsEmulator(Path(tmp) / "gcs")
        emu.start()
        emu.create_bucket("overhead")
        env = {**worker_env(), **emu.env()}
        try:
            run(str(Path(tmp) / "warm"), "warm", a.steps, a.every, env)
            times: dict[str, list[float]] = {"local": [], "bucket": []}
            loads = []
            for i in range(a.repeats):
                for where in ("local", "bucket"):
                    out = str(Path(tmp) / "local") if where == "local" else "gs://overhead/runs"
                    loads.append(round(os.getloadavg()[0], 2))
                    s = run(out, f"r{i}", a.steps, a.every, env)
                    times[where].append(round(s, 2))
                    print(json.dumps({"where": where, "repeat": i, "wall_s": round(s, 2)}))
        finally:
            emu.stop()
    ratios = [b / loc for b, loc in zip(times["bucket"], times["local"], strict=True)]
    print(
        json.dumps(
            {
                "steps": a.steps,
                "every": a.every,
                "local_s": times["local"],
                "bucket_s": times["bucket"],
                "ratio_median": round(statistics.median(ratios), 3),
                "load_avg_1m": loads + [round(os.getloadavg()[0], 2)],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
