"""`rl-jax plan` with its compiles one at a time against --jobs N threads; one JSON line.

    python benchmarks/plan_jobs.py [--jobs 2] [--repeats 1] RECIPE --topology NAME [key=value ...]

Runs the same plan as fresh processes (`rl-jax plan ... --json`), alternating
`--jobs 1` (the baseline) and `--jobs N`, and reports per setting the wall time,
user+system CPU seconds and peak RSS of each process (medians over --repeats), the
wall speedup, and whether the two plans agree (every program's HBM and FLOPs equal).
With no recipe it plans a tiny ScaleRL run on v5e:2x2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT  # noqa: E402

# The tiny model at the test suite's lengths: a plan of a few dozen compiles of seconds.
TINY = "scalerl --topology v5e:2x2 model.preset=tiny model.num_layers=2 data.prompts_per_batch=4"
TINY = [*TINY.split(), "sampling.n=2", "sampling.max_prompt_len=16", "sampling.max_new_tokens=16"]


def _run(plan_args: list[str], jobs: int) -> dict:
    cmd = [sys.executable, "-m", "rl_jax.cli", "plan", *plan_args, "--json", "--jobs", str(jobs)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"plan_jobs: `{' '.join(cmd)}` failed ({status})")
    plan = json.loads(out.decode().strip().splitlines()[-1])
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "plan": plan,
    }


def _facts(plan: dict) -> list:
    """What must not depend on how the programs were compiled."""
    keys = ("hbm_total_gb", "flops", "bytes_accessed", "fits")
    return [(p["name"], *(p[k] for k in keys)) for p in plan["programs"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2, help="threads of the compared setting")
    p.add_argument("--repeats", type=int, default=1)
    a, plan_args = p.parse_known_args(argv)
    plan_args = plan_args or TINY
    runs = {1: [], a.jobs: []}
    for _ in range(a.repeats):
        for jobs in runs:
            runs[jobs].append(_run(plan_args, jobs))
    med = {
        jobs: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s", "peak_rss_mb")}
        for jobs, rs in runs.items()
    }
    base, new = med[1], med[a.jobs]
    facts = {_facts(r["plan"]).__repr__() for rs in runs.values() for r in rs}
    out = {
        "plan": plan_args,
        "jobs": a.jobs,
        "wall_s": round(new["wall_s"], 1),
        "wall_s_jobs1": round(base["wall_s"], 1),
        "speedup_vs_jobs1": round(base["wall_s"] / new["wall_s"], 3),
        "cpu_s": round(new["cpu_s"], 1),
        "cpu_s_jobs1": round(base["cpu_s"], 1),
        "peak_rss_mb": round(new["peak_rss_mb"]),
        "peak_rss_mb_jobs1": round(base["peak_rss_mb"]),
        "same_plan": len(facts) == 1,
        "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
