"""Time of one RL step of rl_jax on the reference workload (optionally against TRL); one JSON line.

Reference workload (issue 8): the `bench` preset (Qwen2 layout, V 512, D 256,
F 688, 4 layers, 4 heads, 2 kv heads, untied, 3.17M parameters); 8 prompts x
8 samples; 8-token prompts (`123+456=`, data.difficulty=3); 64 new tokens
forced (no stop token); reward 1 if the completion starts with the right
answer (`arith`); GRPO loss (loss.name=grpo), one AdamW step per batch, no KL,
every row trained (zero-variance filter off); float32 on this machine's CPU.

The workload runs through the real `RLTrainer.run_loop()` (recipe `scalerl`
with the overrides in `rl_overrides`) in a worker process; a step hook times
each step and reads the trainer's own phase timers (`time/sample_s`,
`time/score_s`, `time/train_s`). One worker starts with an empty JAX
compilation cache (`first_step_s`, compilation included), a second with the
cache the first one filled (`first_step_warm_cache_s`).

    python benchmarks/rl_step.py [--model HF_DIR] [--vs-trl] [--steps N] [--smoke]

--vs-trl also runs TRL's GRPOTrainer (benchmarks/trl_grpo.py, in its own
virtual environment under .cache/bench/trl-venv, created on first use) on the
same weights and prompts: 8 x 8 rows, 64 completion tokens forced (EOS
suppressed), beta=0, one optimizer step per generation. The two workers stay
alive side by side and take their timed steps alternately (ABBA order), so
load from other processes on the machine hits both alike.

Keys: median_step_s (wall time of a warm step: sample + score + train + the
loop's bookkeeping), sample_s / score_s / train_s (medians of the trainer's
timers), first_step_s (first step in a fresh process with an empty compilation
cache, compilation included), first_step_warm_cache_s (a second process on
JAX's persistent compilation cache: every function traced and lowered, XLA's
compile read back), init_s / startup_s
(trainer construction; process start to the end of the first step),
peak_rss_mb (of the cold process; peak_rss_warm_cache_mb of the second one),
sampler_tokens_per_s, flops_fraction (model FLOPs per second of a warm step over this
machine's float32 1024x1024 matmul rate, measured by the driver process between the
steps of the same run), recompiled (a jitted function compiled again after the first
step), load_avg_1m; with --vs-trl: trl_* keys and speedup_vs_trl (TRL step /
ours), trl_generate_tokens_per_s and sampler_speedup_vs_hf_generate (TRL
generates with transformers' `generate`), or trl_error if TRL could not be
set up. --no-malloc-trim measures without rl_jax.runtime's heap trim.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_T0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    TAG,
    emit,
    jax_matmul_rate,
    load_avg,
    median,
    peak_rss_mb,
    wait_command,
    worker_env,
)

TRL_VENV = os.path.join(ROOT, ".cache", "bench", "trl-venv")
TRL_PINS = ("torch==2.13.0", "trl==1.16.0", "transformers==5.24.0")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="HF-format model directory (default: bench preset)")
    p.add_argument("--steps", type=int, default=6, help="timed warm steps per framework")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first one")
    p.add_argument("--vs-trl", action="store_true", help="also time TRL's GRPOTrainer")
    p.add_argument("--trl-python", default="", help="python of an existing TRL environment")
    p.add_argument(
        "--platform",
        default="cpu",
        choices=("cpu", "gpu"),
        help="gpu: both frameworks on the first GPU (JAX's cuda backend, torch's cuda device)",
    )
    p.add_argument("--no-restart", action="store_true", help="skip the warm-cache restart")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 steps (tests)")
    p.add_argument(
        "--cache-dir", default="", help="JAX compilation cache (default: a fresh temporary one)"
    )
    p.add_argument("--set", action="append", default=[], help="extra rl_jax override key=value")
    p.add_argument(
        "--no-malloc-trim",
        action="store_true",
        help="keep the compiler's freed heap (rl-jax commands return it to the OS after every "
        "XLA compilation: rl_jax.runtime.trim_heap_after_compiles)",
    )
    # Internal: the worker side.
    p.add_argument("--worker", choices=("rl",), default=None, help=argparse.SUPPRESS)
    p.add_argument("--export-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--problems-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--run-root", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def rl_overrides(a) -> list[str]:
    """The reference workload as overrides of the `scalerl` recipe."""
    if a.smoke:
        size = ["model.preset=tiny", "sampling.n=2", "data.prompts_per_batch=2"]
        size += ["sampling.max_new_tokens=8", "data.difficulty=2"]
    else:
        size = ["model.preset=bench", "sampling.n=8", "data.prompts_per_batch=8"]
        size += ["sampling.max_new_tokens=64", "data.difficulty=3"]
    ov = size + [
        "sampling.temperature=1.0",
        "sampling.length_control=truncate",
        "sampling.length_bucket=8",
        "sampling.max_prompt_len=64",
        "sampling.decode_chunk=0",
        "sampling.ignore_eos=true",  # forced length (a random model may emit EOS)
        "train.off_policy=on_policy",
        "train.off_policy_k=1",
        "train.updates_per_batch=1",
        "train.steps=100000",  # the benchmark stops the loop itself
        "loss.name=grpo",
        "loss.kl_coef=0.0",
        "data.zero_variance_filter=false",
        "data.no_positive_resampling=false",
        "data.dynamic_sampling=false",
        "eval.every=0",
        "eval.at_start=false",
        "logging.tensorboard=false",
        "logging.progress=false",
        "checkpoint.every=0",
        "checkpoint.resume=false",
        "rewards.name=arith",
    ]
    if a.model:
        ov.append(f"model.path={a.model}")
    return ov + list(a.set)


# ---- the rl_jax worker ----------------------------------------------------------------------


class _Stop(Exception):
    pass


def rl_worker(a) -> int:
    # As every `rl-jax` command does (rl_jax.runtime), so the numbers are the CLI's.
    from rl_jax.runtime import enable_compile_cache, trim_heap_after_compiles

    if a.cache_dir:
        enable_compile_cache(a.cache_dir)
    if not a.no_malloc_trim:
        trim_heap_after_compiles()
    from rl_jax.config import load_recipe
    from rl_jax.train.loop import RLTrainer

    cfg = load_recipe("scalerl", rl_overrides(a))
    t = time.perf_counter()
    trainer = RLTrainer(cfg, run_root=a.run_root or None, quiet=True)
    init_s = time.perf_counter() - t
    if a.export_dir:
        _export(trainer, a.export_dir)
    if a.problems_out:
        _write_problems(trainer, a.problems_out)

    st = {"resume": time.perf_counter(), "first": True, "counters": trainer.counters.as_dict()}
    first_counts: dict = {}

    def hook(trainer) -> None:
        now = time.perf_counter()
        row = _last_row(trainer.run.metrics_path)
        c = trainer.counters.as_dict()
        rec = {
            "step_s": now - st["resume"],
            "loop_step_s": row.get("time/step_s"),
            "sample_s": row.get("time/sample_s"),
            "score_s": row.get("time/score_s"),
            "train_s": row.get("time/train_s"),
            "flops": c["flops"] - st["counters"]["flops"],
            "sampler_flops": c["sampler_flops"] - st["counters"]["sampler_flops"],
            "trainer_flops": c["trainer_flops"] - st["counters"]["trainer_flops"],
            "response_len": row.get("train/response_len"),
            "load_avg_1m": load_avg(),
        }
        st["counters"] = c
        if st["first"]:
            st["first"] = False
            first_counts.update(trainer.compile_counts())
            rec.update(
                first=True,
                init_s=init_s,
                startup_s=now - _T0,
                compile_counts=first_counts,
                rows=int(trainer.prompts_per_batch * trainer.samples_per_prompt),
                new_tokens=int(trainer.cfg.sampling.max_new_tokens),
            )
        emit(rec)
        if wait_command() == "stop":
            raise _Stop
        st["resume"] = time.perf_counter()

    trainer.step_hooks.append(hook)
    try:
        trainer.run_loop()
    except _Stop:
        pass
    counts = trainer.compile_counts()
    trainer.close()
    emit(
        {
            "final": True,
            "peak_rss_mb": peak_rss_mb(),
            "compile_counts": counts,
            "recompiled": any(counts[k] > first_counts.get(k, 0) for k in counts),
        }
    )
    return 0


def _last_row(path) -> dict:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        lines = f.read().splitlines()
    return json.loads(lines[-1]) if lines else {}


def _export(trainer, out_dir: str) -> None:
    """The trainer's initial weights as an HF directory, its tokenizer, and the prompts."""
    from rl_jax.models import Transformer, export_hf

    model = Transformer(trainer.spec, dict(trainer.params))
    export_hf(model, out_dir)
    trainer.tokenizer.save(out_dir)  # the char tokenizer writes an HF one with its ids


def _write_problems(trainer, path: str) -> None:
    probs = [{"prompt": p.prompt, "answer": p.answer} for p in list(trainer.task.train)]
    with open(path, "w") as f:
        json.dump({"problems": probs}, f)


# ---- the driver -----------------------------------------------------------------------------


class Worker:
    """A benchmark worker process speaking the `_common` protocol."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench_{name}_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.records: list[dict] = []

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                with open(self.log.name) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"{self.name} worker exited ({self.proc.returncode}):\n{tail}")
            if line.startswith(TAG):
                rec = json.loads(line[len(TAG) :])
                self.records.append(rec)
                return rec

    def step(self) -> dict:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> dict:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        rec = self.read()
        self.proc.wait(timeout=120)
        os.unlink(self.log.name)
        return rec

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _rl_argv(
    a, cache_dir: str, run_root: str, export_dir: str = "", problems: str = ""
) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "rl"]
    argv += ["--cache-dir", cache_dir, "--run-root", run_root]
    if a.model:
        argv += ["--model", a.model]
    if a.smoke:
        argv.append("--smoke")
    if a.no_malloc_trim:
        argv.append("--no-malloc-trim")
    for s in a.set:
        argv += ["--set", s]
    if export_dir:
        argv += ["--export-dir", export_dir]
    if problems:
        argv += ["--problems-out", problems]
    return argv


def trl_python(a) -> str:
    """The TRL environment's python, created on first use (CPU torch from the local wheels)."""
    if a.trl_python:
        return a.trl_python
    py = os.path.join(TRL_VENV, "bin", "python")
    ok = os.path.join(TRL_VENV, ".installed")
    if not os.path.exists(ok):
        subprocess.run([sys.executable, "-m", "venv", TRL_VENV], check=True)
        subprocess.run(
            [py, "-m", "pip", "install", "-q", *TRL_PINS],
            check=True,
            capture_output=True,
            text=True,
        )
        open(ok, "w").close()
    return py


def _summary(prefix: str, first: dict, steps: list[dict], final: dict) -> dict:
    step_s = median(r["step_s"] for r in steps)
    out = {
        f"{prefix}median_step_s": step_s,
        f"{prefix}sample_s": median(r.get("sample_s") for r in steps),
        f"{prefix}score_s": median(r.get("score_s") for r in steps),
        f"{prefix}train_s": median(r.get("train_s") for r in steps),
        f"{prefix}first_step_s": first.get("first_step_s", first["step_s"]),
        f"{prefix}startup_s": first.get("startup_s"),
        f"{prefix}peak_rss_mb": final.get("peak_rss_mb"),
        f"{prefix}step_s_all": [round(r["step_s"], 3) for r in steps],
    }
    return out


def _round(d: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def main(a) -> int:
    gpu = a.platform == "gpu"
    if gpu:
        os.environ["JAX_PLATFORMS"] = "cuda"  # inherited by the workers (worker_env)
        # The workers share the card: JAX takes memory as it needs it, not 75% up front.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the driver's matmul-rate probe
    tmp = tempfile.mkdtemp(prefix="rl_step_bench_")
    cache = a.cache_dir or os.path.join(tmp, "jax_cache")
    env = worker_env()
    result: dict = {}
    workers: list[Worker] = []
    try:
        export = os.path.join(tmp, "hf") if a.vs_trl and not a.model else ""
        problems = os.path.join(tmp, "problems.json") if a.vs_trl else ""
        runs = os.path.join(tmp, "runs")
        rl = Worker("rl_jax", _rl_argv(a, cache, runs, export, problems), env)
        workers.append(rl)
        rl_first = rl.read()
        trl = None
        if a.vs_trl:
            try:
                py = trl_python(a)
                hf_dir = a.model or export
                trl_argv = [py, os.path.join(HERE, "trl_grpo.py"), "--model", hf_dir]
                trl_argv += ["--problems", problems]
                if a.smoke:
                    trl_argv.append("--smoke")
                if gpu:
                    trl_argv += ["--device", "cuda"]
                path = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))
                trl = Worker("trl", trl_argv, dict(os.environ, PYTHONPATH=path))
                workers.append(trl)
                trl_first = trl.read()
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                result["trl_error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
                if trl is not None:
                    trl.kill()
                trl = None
        pair = [rl] if trl is None else [rl, trl]
        for _ in range(a.warmup):
            for w in pair:
                w.step()
        timed: dict[str, list[dict]] = {w.name: [] for w in pair}
        rates = []
        for i in range(a.steps):
            order = pair if i % 4 in (0, 3) else pair[::-1]  # ABBA
            for w in order:
                timed[w.name].append(w.step())
            # Measured here, between the workers' steps, so the measurement's own arrays
            # and compilation do not count toward the workers' peak memory.
            rates.append(jax_matmul_rate())
        finals = {w.name: w.stop() for w in pair}

        rl_steps = timed["rl_jax"]
        result.update(_summary("", rl_first, rl_steps, finals["rl_jax"]))
        flops = median(r["flops"] for r in rl_steps)
        rate = median(rates)
        result.update(
            {
                "first_step_warm_cache_s": None,
                "init_s": rl_first["init_s"],
                "flops_fraction": flops / result["median_step_s"] / rate,
                "achieved_gflops": flops / result["median_step_s"] / 1e9,
                "matmul_gflops": rate / 1e9,
                "step_gflop": flops / 1e9,
                "sampler_gflop": median(r["sampler_flops"] for r in rl_steps) / 1e9,
                "trainer_gflop": median(r["trainer_flops"] for r in rl_steps) / 1e9,
                "response_len": median(r["response_len"] for r in rl_steps),
                "recompiled": finals["rl_jax"]["recompiled"],
                "compile_counts": finals["rl_jax"]["compile_counts"],
            }
        )
        tokens = rl_first["rows"] * rl_first["new_tokens"]
        result["sampler_tokens_per_s"] = tokens / result["sample_s"]
        if trl is not None:
            result.update(_summary("trl_", trl_first, timed["trl"], finals["trl"]))
            result["speedup_vs_trl"] = result["trl_median_step_s"] / result["median_step_s"]
            # TRL generates with transformers' `generate` (same rows, same forced length).
            result["trl_generate_tokens_per_s"] = tokens / result["trl_sample_s"]
            result["sampler_speedup_vs_hf_generate"] = result["trl_sample_s"] / result["sample_s"]
            result["trl_version"] = trl_first.get("version")

        if not a.no_restart:
            # A second fresh process on the compilation cache the first one filled.
            rl2 = Worker("rl_jax_warm", _rl_argv(a, cache, os.path.join(tmp, "runs2")), env)
            workers.append(rl2)
            r2 = rl2.read()
            for _ in range(min(2, a.steps)):  # a few warm steps for its memory peak
                rl2.step()
            f2 = rl2.stop()
            result["first_step_warm_cache_s"] = r2["step_s"]
            result["peak_rss_warm_cache_mb"] = f2["peak_rss_mb"]
            result["startup_warm_cache_s"] = r2["startup_s"]
            result["init_warm_cache_s"] = r2["init_s"]
        result.update(
            {
                "model": a.model or ("preset:tiny (smoke)" if a.smoke else "preset:bench"),
                "rows": rl_first["rows"],
                "steps_timed": a.steps,
                "loss": "grpo",
                "load_avg_1m": load_avg(),
                "load_avg_during": median(r["load_avg_1m"] for r in rl_steps),
                "cpus": len(os.sched_getaffinity(0)),
                "platform": a.platform,
            }
        )
    finally:
        for w in workers:
            w.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(_round(result)))
    return 0


if __name__ == "__main__":
    args = _parse(sys.argv[1:])
    if args.smoke:
        args.steps = min(args.steps, 2)
        args.warmup = 0
    sys.exit(rl_worker(args) if args.worker == "rl" else main(args))
