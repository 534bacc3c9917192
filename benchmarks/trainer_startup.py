"""Start-up cost of the trainer's samplers: the batch Sampler against the engine.

The tests' tiny ScaleRL run (tests/_workers/train_even_first.py), on_policy, 3 steps,
evaluated at the start, at step 2 and at the end, one device: each run in a fresh
process, so its samplers' programs are traced, lowered and compiled (or read from the
compilation cache) anew, as in a test. `sampling.engine=false` and `=true` alternate,
`--pairs` times, each with a cold compilation cache (emptied before the run) and then
with the cache that run filled (warm). One JSON line per run, then a summary line
with the medians:

    {"summary": true, "cold_s": {"false": .., "true": ..}, "warm_s": {...}, ...}

    python benchmarks/trainer_startup.py [--pairs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, tempfile
sys.path.insert(0, "tests/_workers")
import train_even_first
from rl_jax.config import load_recipe
from rl_jax.train.loop import RLTrainer
with tempfile.TemporaryDirectory() as d:
    cfg = load_recipe("scalerl", [*train_even_first.TINY_RUN, "eval.every=2",
        "mesh.num_devices=1", f"out_dir={d}", "train.steps=3", *sys.argv[1:]])
    tr = RLTrainer(cfg, quiet=True)
    tr.run_loop()
    print(json.dumps(tr.compile_counts()))
"""


def _run(engine: str, cache: str) -> dict:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, f"sampling.engine={engine}"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "compile_counts": json.loads(out.stdout.splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    times: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    counts = {}
    for _ in range(args.pairs):
        for engine in ("false", "true"):
            cache = tempfile.mkdtemp(prefix="jc_startup_")
            try:
                for kind in ("cold", "warm"):
                    r = _run(engine, cache)
                    times[kind].setdefault(engine, []).append(r["wall_s"])
                    counts[engine] = r["compile_counts"]
                    print(json.dumps({"engine": engine, "cache": kind, **r}), flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    summary = {
        f"{kind}_s": {e: round(statistics.median(v), 2) for e, v in t.items()}
        for kind, t in times.items()
    }
    programs = {e: sum(1 for n in c.values() if n) for e, c in counts.items()}
    print(json.dumps({"summary": True, **summary, "programs": programs, "pairs": args.pairs}))


if __name__ == "__main__":
    main()
