"""Sampling throughput against transformers' `generate` on the same weights; one JSON line.

Reference workload: the `bench` preset, 8 prompts x 8 samples = 64 rows,
8-token prompts, 64 new tokens per row forced (no stop token), float32, CPU,
temperature 1. Both samplers run in this process, alternately, so that load
from other processes on the machine hits both alike; the medians are reported.

    python benchmarks/sampler.py [--model HF_DIR | --preset NAME] [--devices N] [--repeats R]
    python benchmarks/sampler.py --platform gpu [--dtype bfloat16] ...   # on a GPU machine
    python benchmarks/sampler.py --hf-only    # transformers alone, no JAX work in the process

Inside a process that holds one XLA CPU device per core (--devices 0),
`generate` ran ~20% slower than alone on the 2-core machine (README,
Performance); --hf-only gives the undisturbed baseline.

--new-tokens N times longer generations (a CPU decode step reads only the filled
slots of its cache: in the attention kernel, or without it in blocks past 128
slots; rl_jax/kernels/cpu.py, rl_jax/kernels/xla.py).

--vs-xla times a second sampler on the same weights with the CPU decode kernels off
(rl_jax.kernels.cpu: attention and matmuls in XLA instead), alternating with ours
in the same process; keys xla_tokens_per_s and kernel_speedup.

--lengths longtail times the continuous-batching engine (rl_jax.sampling.Engine)
against waves (batches decoded in step) on a long-tailed workload: --waves x --prompts prompts
of --samples rows each, every row ended at a length drawn from a lognormal of median
--new-tokens / 8 (sigma --sigma, clipped to [1, --new-tokens]; the same lengths for
both, as per-row limits, which end a row as a stop token would). The waves
generate --prompts prompts at a time (PipelineRL's wave: each until its longest row
ends); the engine has --slots slots (default the wave's rows), refilled after --chunk
steps or as soon as --refill-min slots are free. Its defaults are the workload
docs/results/performance.md reports: 64 waves (4096 rows), a 256-token cap, one timed run
of each (`--new-tokens 256 --waves 64 --repeats 1`); a much smaller one times mostly
the drain at its end (the last, longest rows finishing while slots empty), not the
engine. Keys: occupancy / occupancy_wave
(the fraction of slot-steps, rows x decode steps run, that produced a kept token),
tokens_per_s / tokens_per_s_wave (kept tokens per second over the whole workload,
median of the repeats, the two alternating), speedup_vs_wave, device_idle (the
fraction of the engine's run the device had no program queued: the gaps between a
chunk's end and the host's next dispatch, `Engine.run(timeline=True)`), overlap
(whether the engine's host loop dispatched chunk k + 1 before reading chunk k;
--no-overlap reads each chunk first), and load_avg_start / load_avg_end (the 1, 5
and 15-minute load averages).

The reference workload times the engine as the trainer builds it for one batch (a
slot per row, one chunk to the end, fixed shapes: `Engine.for_batch`).

--platform gpu runs both samplers on the first GPU (JAX's cuda backend, transformers
on torch's cuda device) and times them with their results synchronized to the host;
--dtype sets both models' parameter and compute dtype.

Keys: tokens_per_s / hf_tokens_per_s (generated tokens per second after
warm-up), speedup, first_call_s (our first call, compilation included; a
persistent JAX compilation cache, if configured, shortens it: see
compile_cache), flops_fraction (model FLOPs per second of our sampler over
this machine's measured float32 matmul rate on the same devices). Every mode
records load_avg_1m_start / load_avg_1m_end, the machine's 1-minute load average
when the process started and when the result was written.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="HF-format model directory (default: bench preset)")
    p.add_argument("--preset", default="bench", help="model preset when --model is not given")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="CPU devices, rows split over them (0 = one per core)",
    )
    p.add_argument("--hf-threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs of each sampler (default 5; --lengths longtail: 1)",
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens per row (default 64; --lengths longtail: the cap of the drawn lengths, 256)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers measurement")
    p.add_argument(
        "--lengths",
        default="fixed",
        choices=("fixed", "longtail"),
        help="fixed: every row --new-tokens (the reference); longtail: engine vs waves",
    )
    p.add_argument("--waves", type=int, default=64, help="longtail: waves of --prompts prompts")
    p.add_argument("--slots", type=int, default=0, help="longtail: engine slots (0 = a wave)")
    p.add_argument("--chunk", type=int, default=8, help="longtail: engine steps per refill")
    p.add_argument("--sigma", type=float, default=1.0, help="longtail: lognormal sigma")
    p.add_argument(
        "--refill-min",
        type=int,
        default=0,
        help="longtail: free slots that end a chunk early (0 = the engine's default)",
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="longtail: the engine reads each chunk before dispatching the next",
    )
    p.add_argument(
        "--vs-xla",
        action="store_true",
        help="also time the same sampler with the CPU decode kernels off (XLA's attention "
        "and matmuls), alternating with ours: what the kernels buy",
    )
    p.add_argument(
        "--hf-only",
        action="store_true",
        help="time transformers alone (no JAX computation in the process): the baseline "
        "without any interference from our runtime's threads",
    )
    a = p.parse_args(argv)
    # The long-tail workload's defaults are the one docs/results/performance.md measures: 4096 rows
    # whose lengths run to 256 tokens. With fewer rows the engine's run is mostly its drain
    # (the last, longest rows finishing in emptying slots), which no scheduler avoids.
    longtail = a.lengths == "longtail"
    if a.new_tokens is None:
        a.new_tokens = 256 if longtail else 64
    if a.repeats is None:
        a.repeats = 1 if longtail else 5
    return a


ARGS = _parse(sys.argv[1:])
# Before any work of ours: what else loads the machine (the timings alternate samplers so
# that load hits both alike, but a loaded machine slows both).
LOAD_AVG_START = os.getloadavg()
GPU = ARGS.platform == "gpu"
if GPU:
    DEVICES = 1
    os.environ["JAX_PLATFORMS"] = "cuda"
    # torch shares the card: JAX takes memory as it needs it instead of 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    DEVICES = ARGS.devices or len(os.sched_getaffinity(0))
    # The device count must be fixed before jax is imported.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax.config import MeshConfig, ModelConfig, SamplingConfig  # noqa: E402
from rl_jax.models import export_hf, load_model, model_params  # noqa: E402
from rl_jax.sampling import Engine  # noqa: E402
from rl_jax.sharding import make_mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import jax_matmul_rate  # noqa: E402

from rl_jax.train.accounting import forward_flops  # noqa: E402


def hf_generate_fn(model_dir: str, prompts: np.ndarray, samples: int, new_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if ARGS.hf_threads:
        torch.set_num_threads(ARGS.hf_threads)

    device = "cuda" if GPU else "cpu"
    dtype = getattr(torch, ARGS.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    ids = torch.as_tensor(prompts, dtype=torch.long, device=device)
    gen_cfg = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        num_return_sequences=samples,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,  # forced length, as ours
        pad_token_id=0,
    )

    def run(seed: int):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg
            )
        out = out.cpu()  # waits for the device, as ours returns host arrays
        assert out.shape == (prompts.shape[0] * samples, prompts.shape[1] + new_tokens)

    return run


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> int:
    a = ARGS
    mesh = make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)) if DEVICES > 1 else None
    source = a.model or ModelConfig(preset=a.preset, param_dtype=a.dtype, compute_dtype=a.dtype)
    model = load_model(source, mesh=mesh, purpose="sample", rules_preset="dp")
    spec = model.spec
    params = model_params(model)
    rows = a.prompts * a.samples
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, spec.vocab_size, size=(a.prompts, a.prompt_len), dtype=np.int32)
    cfg = SamplingConfig(
        n=a.samples,
        temperature=1.0,
        max_new_tokens=a.new_tokens,
        max_prompt_len=a.prompt_len,
        length_bucket=8,
    )
    if a.hf_only:  # before the sampler exists: nothing of ours built or run
        return _hf_only(model, prompts)
    if a.lengths == "longtail":
        return _longtail(spec, params, mesh)
    prompt_list = prompts.tolist()
    # The engine as the trainer builds it for a batch: a slot per row, one chunk to the
    # end, fixed shapes.
    batch = dict(prompts=a.prompts, prompt_len=a.prompt_len, mesh=mesh, pad_id=0, rules="dp")
    sampler = Engine.for_batch(spec, cfg, **batch)

    def ours(seed: int):
        out, _ = sampler.run(params, prompt_list, seed=seed)
        assert (out.lengths == a.new_tokens).all()

    t = time.perf_counter()
    ours(0)
    first_call = time.perf_counter() - t

    xla_run = None
    if a.vs_xla:
        plain = Engine.for_batch(spec, cfg, **batch)
        # Read when its functions are first traced: set before the first call.
        plain.platform_attention = plain.platform_matmul = False

        def xla_run(seed: int):
            out, _ = plain.run(params, prompt_list, seed=seed)
            assert (out.lengths == a.new_tokens).all()

        xla_run(0)

    hf_run = None
    if not a.no_hf:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = a.model or str(export_hf(model, tmp, dtype=a.dtype))
            hf_run = hf_generate_fn(hf_dir, prompts, a.samples, a.new_tokens)
            hf_run(0)  # warm-up

    ours_t, hf_t, xla_t = [], [], []
    for r in range(a.repeats):
        t = time.perf_counter()
        ours(r + 1)
        ours_t.append(time.perf_counter() - t)
        if xla_run is not None:
            t = time.perf_counter()
            xla_run(r + 1)
            xla_t.append(time.perf_counter() - t)
        if hf_run is not None:
            t = time.perf_counter()
            hf_run(r + 1)
            hf_t.append(time.perf_counter() - t)

    tokens = rows * a.new_tokens
    ours_s = statistics.median(ours_t)
    # Model FLOPs of one run, as runs count them (each prompt once, every new token).
    flops = forward_flops(spec, [a.prompt_len] * a.prompts, [a.new_tokens] * rows, a.samples)
    # This machine's matmul rate on the sampler's devices, in the sampler's dtype.
    peak = jax_matmul_rate(repeats=5, mesh=mesh, dtype=a.dtype)
    result = {
        "tokens_per_s": round(tokens / ours_s, 1),
        "first_call_s": round(first_call, 3),
        "hf_tokens_per_s": round(tokens / statistics.median(hf_t), 1) if hf_t else None,
        "speedup": round(statistics.median(hf_t) / ours_s, 3) if hf_t else None,
        "xla_tokens_per_s": round(tokens / statistics.median(xla_t), 1) if xla_t else None,
        "kernel_speedup": round(statistics.median(xla_t) / ours_s, 3) if xla_t else None,
        "flops_fraction": round(flops / ours_s / peak, 4),
        "seconds": round(ours_s, 4),
        "hf_seconds": round(statistics.median(hf_t), 4) if hf_t else None,
        "achieved_gflops": round(flops / ours_s / 1e9, 2),
        "matmul_gflops": round(peak / 1e9, 2),
        "model": a.model or f"preset:{a.preset}",
        "dtype": a.dtype,
        "platform": a.platform,
        "device_kind": jax.devices()[0].device_kind,
        "rows": rows,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "devices": DEVICES,
        # Decode attention / projections in the CPU kernels (rl_jax/kernels/cpu.py).
        "attention_kernel": "attention" in sampler.decode_ops.platform_ops,
        "matmul_kernel": "matmul" in sampler.decode_ops.platform_ops,
        "hf_threads": _torch_threads() if hf_t else None,
        "compile_cache": bool(os.environ.get("JAX_COMPILATION_CACHE_DIR")),
        **_load_avg(),
    }
    print(json.dumps(result))
    return 0


def _longtail(spec, params, mesh) -> int:
    """Engine against waves on long-tailed lengths; one JSON line (module docstring)."""
    a = ARGS
    rng = np.random.default_rng(0)
    n_prompts, cap = a.waves * a.prompts, a.new_tokens
    prompts = rng.integers(1, spec.vocab_size, size=(n_prompts, a.prompt_len)).tolist()
    draw = rng.lognormal(np.log(cap / 8), a.sigma, size=n_prompts * a.samples)
    limits = np.clip(np.round(draw), 1, cap).astype(np.int32)  # row r = p * n + s
    cfg = SamplingConfig(
        n=a.samples,
        temperature=1.0,
        max_new_tokens=cap,
        max_prompt_len=a.prompt_len,
        length_bucket=8,
    )
    # A wave: a batch decoded in step until its longest row ends.
    wave = Engine.for_batch(
        spec, cfg, prompts=a.prompts, prompt_len=a.prompt_len, mesh=mesh, pad_id=0, rules="dp"
    )
    slots = a.slots or a.prompts * a.samples
    engine = Engine(spec, cfg, slots=slots, chunk=a.chunk, mesh=mesh, pad_id=0, rules="dp")
    wave_rows = a.prompts * a.samples

    def waves(seed: int) -> tuple[int, int]:
        kept = slot_steps = 0
        for w in range(a.waves):
            rows = slice(w * wave_rows, (w + 1) * wave_rows)
            out, _ = wave.run(
                params,
                prompts[w * a.prompts : (w + 1) * a.prompts],
                seed=seed,
                row_ids=np.arange(rows.start, rows.stop),
                max_new_tokens=limits[rows],
            )
            assert (out.lengths == limits[rows]).all()
            kept += int(out.completion_mask.sum())
            slot_steps += wave_rows * int(out.lengths.max())  # it decodes to the longest
        return kept, slot_steps

    idle = []

    def continuous(seed: int) -> tuple[int, int]:
        out, stats = engine.run(
            params,
            prompts,
            seed=seed,
            max_new_tokens=limits,
            refill_min=a.refill_min or None,
            overlap=not a.no_overlap,
            timeline=True,
        )
        assert (out.lengths == limits).all() and stats.pages_held == 0
        idle.append(stats.device_idle)
        return stats.kept_tokens, stats.slot_steps

    t = time.perf_counter()
    continuous(0)
    first_call = time.perf_counter() - t
    waves(0)
    eng_t, wave_t = [], []
    for r in range(a.repeats):
        t = time.perf_counter()
        kept, eng_steps = continuous(r + 1)
        eng_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        kept_w, wave_steps = waves(r + 1)
        wave_t.append(time.perf_counter() - t)
    assert kept == kept_w == int(limits.sum())
    eng_s, wave_s = statistics.median(eng_t), statistics.median(wave_t)
    result = {
        "occupancy": round(kept / eng_steps, 4),
        "occupancy_wave": round(kept / wave_steps, 4),
        "tokens_per_s": round(kept / eng_s, 1),
        "tokens_per_s_wave": round(kept / wave_s, 1),
        "speedup_vs_wave": round(wave_s / eng_s, 3),
        "device_idle": round(statistics.median(idle[1:]), 4),
        "overlap": not a.no_overlap,
        "seconds": round(eng_s, 3),
        "seconds_wave": round(wave_s, 3),
        "first_call_s": round(first_call, 3),
        "kept_tokens": kept,
        "rows": len(limits),
        "slots": slots,
        "chunk": a.chunk,
        "refill_min": a.refill_min or max(1, slots // 64),
        "wave_rows": wave_rows,
        "cap": cap,
        "median_len": float(np.median(limits)),
        "mean_len": round(float(limits.mean()), 1),
        "sigma": a.sigma,
        "model": a.model or f"preset:{a.preset}",
        "dtype": a.dtype,
        "platform": a.platform,
        "devices": DEVICES,
        "prompt_len": a.prompt_len,
        "compiles": engine.compile_counts(),
        "page_size": engine.page_size,
        **_load_avg(),
    }
    print(json.dumps(result))
    return 0


def _hf_only(model, prompts: np.ndarray) -> int:
    """`generate` alone, a.repeats timed runs after a warm-up; one JSON line."""
    a = ARGS
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = a.model or str(export_hf(model, tmp, dtype=a.dtype))
        hf_run = hf_generate_fn(hf_dir, prompts, a.samples, a.new_tokens)
        hf_run(0)
        times = []
        for r in range(a.repeats):
            t = time.perf_counter()
            hf_run(r + 1)
            times.append(time.perf_counter() - t)
    hf_s = statistics.median(times)
    tokens = a.prompts * a.samples * a.new_tokens
    result = {
        "hf_tokens_per_s": round(tokens / hf_s, 1),
        "hf_seconds": round(hf_s, 4),
        "hf_threads": _torch_threads(),
        "model": a.model or f"preset:{a.preset}",
        "rows": a.prompts * a.samples,
        "new_tokens": a.new_tokens,
        **_load_avg(),
    }
    print(json.dumps(result))
    return 0


def _load_avg() -> dict:
    """The 1-minute load average when the process started and now (at the result)."""
    end = os.getloadavg()
    return {
        "load_avg_1m_start": round(LOAD_AVG_START[0], 2),
        "load_avg_1m_end": round(end[0], 2),
        "load_avg_start": [round(x, 2) for x in LOAD_AVG_START],
        "load_avg_end": [round(x, 2) for x in end],
    }


if __name__ == "__main__":
    sys.exit(main())
