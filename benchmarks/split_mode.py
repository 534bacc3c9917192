"""Split mode against colocated PipelineRL on the rl_step workload: steps per second; one JSON line.

The reference workload of benchmarks/rl_step.py (bench preset, 8 prompts x 8
samples, 64 forced new tokens, GRPO, one AdamW step per batch, float32 CPU),
trained with PipelineRL-k (k = --k, default 1: two batches in flight) in three
placements, each in its own process on --devices CPU devices:

  colocated_1   one device, sampler and trainer take turns (a plain CPU run)
  colocated     all devices in one mesh, sampler and trainer take turns
  split         the first --sampler-devices devices sample while the rest train

Steps run back to back (no pauses, unlike rl_step.py's alternating protocol,
which would let the split sampler fill its queue between timed steps). Each
process runs --warmup steps, then times --steps steps; reported: seconds per
step (median of the per-step wall times, and the mean over the timed window),
the trainer's wait for rollouts, and for split the seconds the sampler thread
and the trainer worked at the same time. On CPU, devices share the machine's
cores, so split mode gains only what the two halves leave idle of each other.

    python benchmarks/split_mode.py [--devices 2] [--sampler-devices 1] [--steps 8]
        [--placements colocated_1,colocated,split]
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import TAG, emit, load_avg, peak_rss_mb, worker_env  # noqa: E402
from rl_step import _last_row, rl_overrides  # noqa: E402

PLACEMENTS = ("colocated_1", "colocated", "split")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=2, help="CPU devices (default: 2)")
    p.add_argument("--sampler-devices", type=int, default=1)
    p.add_argument("--k", type=int, default=1, help="PipelineRL-k staleness bound")
    p.add_argument("--steps", type=int, default=8, help="timed steps per placement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    p.add_argument(
        "--placements",
        default=",".join(PLACEMENTS),
        help="comma-separated, from " + ", ".join(PLACEMENTS) + " (default: all)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes (tests)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.placements = [x for x in a.placements.split(",") if x]
    unknown = sorted(set(a.placements) - set(PLACEMENTS))
    if unknown or not a.placements:
        p.error(f"--placements: {unknown or 'none given'}; allowed: {', '.join(PLACEMENTS)}")
    return a


def overrides(a, placement: str) -> list[str]:
    ov = rl_overrides(argparse.Namespace(smoke=a.smoke, model="", set=[]))
    ov = [o for o in ov if not o.startswith(("train.off_policy", "train.steps"))]
    ov += [
        "train.off_policy=pipeline",
        f"train.off_policy_k={a.k}",
        f"train.steps={a.warmup + a.steps}",
        # The stream swaps weights every quarter of the generation budget (the default,
        # `accounting.decode_chunk`), colocated or split.
        "sampling.decode_chunk=0",
    ]
    if placement == "colocated_1":
        ov.append("mesh.num_devices=1")
    elif placement == "split":
        ov.append(f"mesh.sampler_devices={a.sampler_devices}")
    return ov


def worker(a) -> int:
    from rl_jax.config import load_recipe
    from rl_jax.runtime import trim_heap_after_compiles
    from rl_jax.train.loop import RLTrainer

    trim_heap_after_compiles()
    cfg = load_recipe("scalerl", overrides(a, a.worker))
    with tempfile.TemporaryDirectory() as root:
        trainer = RLTrainer(cfg, run_root=root, quiet=True)
        stamps: list[float] = [time.perf_counter()]
        waits: list[float] = []

        def hook(t) -> None:
            stamps.append(time.perf_counter())
            waits.append(_last_row(t.run.metrics_path).get("time/sample_s", 0.0))

        trainer.step_hooks.append(hook)
        trainer.run_loop()
        w = a.warmup
        steps = [b - s for s, b in zip(stamps[w:], stamps[w + 1 :], strict=False)]
        rec = {
            "placement": a.worker,
            "median_step_s": round(statistics.median(steps), 4),
            "mean_step_s": round((stamps[-1] - stamps[w]) / len(steps), 4),
            "first_steps_s": round(stamps[w] - stamps[0], 3),
            "wait_for_rollouts_s": round(statistics.median(waits[w:]), 4),
            "sampler_devices": len(trainer.sample_mesh.devices.flat),
            "trainer_devices": len(trainer.mesh.devices.flat),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }
        if trainer.split_sampler is not None:
            rec["overlap_s"] = round(trainer.split_sampler.overlap_s(), 3)
            rec["sampler_busy_s"] = round(trainer.split_sampler.busy_s, 3)
    emit(rec)
    return 0


def run_placement(a, placement: str) -> dict:
    env = worker_env(a.devices)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", placement]
    argv += ["--devices", str(a.devices), "--sampler-devices", str(a.sampler_devices)]
    argv += ["--k", str(a.k), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    if a.smoke:
        argv.append("--smoke")
    out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    raise RuntimeError(f"{placement} worker failed ({out.returncode}):\n{out.stderr[-3000:]}")


def main() -> int:
    a = _parse(sys.argv[1:])
    if a.worker:
        return worker(a)
    res = {p: run_placement(a, p) for p in a.placements}
    mean = {p: r["mean_step_s"] for p, r in res.items()}
    colocated = [mean[p] for p in ("colocated_1", "colocated") if p in mean]
    out = {
        **{f"{p}_mean_step_s": m for p, m in mean.items()},
        # Against the faster colocated placement that ran.
        "split_speedup": round(min(colocated) / mean["split"], 3)
        if colocated and "split" in mean
        else None,
        "devices": a.devices,
        "sampler_devices": a.sampler_devices,
        "k": a.k,
        "steps": a.steps,
        "load_avg_1m": round(load_avg(), 2),
        "placements": res,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
