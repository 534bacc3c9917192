"""PipelineRL's sampling as the trainer runs it, a continuous stream on the engine, against
waves (batches decoded in step) as a baseline built here; one JSON line.

A PipelineRL-k run's sampling with an instant trainer (every batch trained the
moment it is formed, the version advancing by one): --steps batches of --prompts
groups of --samples rows, at most --waves batches untrained at once, every row
ended at a length drawn from a lognormal of median --new-tokens / 8 (sigma
--sigma, clipped to [1, --new-tokens]; the same lengths for both, as per-row
limits, which end a row as a stop token would).

  stream  rl_jax.train.stream on an engine of --slots slots (default W x B_p x n),
          how train.off_policy=pipeline samples: groups enter as slots free up, a
          batch is the next B_p complete groups.
  waves   the baseline (the trainer's PipelineRL sampler until 2e07bd6, gone from
          it since): each batch of --prompts x --samples rows decoded in step, --chunk
          steps a call, on an engine with a slot per row (`Engine.for_batch`) until
          its longest row ends. The waves ran --waves batches round robin; one after
          another they decode the same slot-steps.

Keys: occupancy / occupancy_wave (kept tokens over slot-steps: slots, or a wave's
rows, x decode steps run), tokens_per_s / tokens_per_s_wave (kept tokens per second,
median of --repeats, the two alternating), speedup_vs_wave.

    python benchmarks/pipeline_stream.py [--slots 16] [--waves 3] [--prompts 4]
        [--samples 4] [--steps 12] [--new-tokens 128] [--chunk 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset")
    p.add_argument("--slots", type=int, default=0, help="engine slots (0 = W x B_p x n)")
    p.add_argument("--waves", type=int, default=3, help="W: batches untrained at once")
    p.add_argument("--prompts", type=int, default=4, help="B_p: groups per batch")
    p.add_argument("--samples", type=int, default=4, help="n: rows per group")
    p.add_argument("--steps", type=int, default=12, help="batches")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128, help="the length cap")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--chunk", type=int, default=8, help="decode steps between weight swaps")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _parse(argv)
    import jax
    import numpy as np

    from rl_jax.config import ModelConfig, SamplingConfig
    from rl_jax.models import init_params, resolve_spec
    from rl_jax.sampling import Engine
    from rl_jax.train.stream import EngineStream, StreamBook

    spec = resolve_spec(ModelConfig(preset=a.preset))
    params = init_params(spec, jax.random.key(0))
    P, G, W, cap = a.prompts, a.samples, a.waves, a.new_tokens
    groups = a.steps * P
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, spec.vocab_size, size=(groups, a.prompt_len)).tolist()
    draw = rng.lognormal(np.log(cap / 8), a.sigma, size=(groups, G))
    limits = np.clip(np.round(draw), 1, cap).astype(np.int32)  # [group, sample]
    cfg = SamplingConfig(
        n=G, temperature=1.0, max_new_tokens=cap, max_prompt_len=a.prompt_len, length_bucket=8
    )
    batch = Engine.for_batch(
        spec, _with_chunk(cfg, a.chunk), prompts=P, prompt_len=a.prompt_len, pad_id=0
    )
    slots = a.slots or W * P * G
    engine = Engine(spec, cfg, slots=slots, chunk=a.chunk, pad_id=0, fixed_shapes=True)

    def waves(seed: int) -> tuple[int, int]:
        """The waves baseline: each batch decoded until its longest row ends; that batch
        trains at once (the version advances)."""
        key = jax.random.key(seed)
        kept = slot_steps = 0
        for version in range(a.steps):
            g = slice(version * P, (version + 1) * P)
            rollouts, _ = batch.run(
                params,
                prompts[g],
                n=G,
                key=key,
                version=version,
                row_ids=np.arange(g.start * G, g.stop * G),
                max_new_tokens=limits[g].reshape(-1),
            )
            kept += int(rollouts.completion_mask.sum())
            slot_steps += P * G * int(rollouts.lengths.max())  # a wave decodes to its longest row
        return kept, slot_steps

    def stream(seed: int) -> tuple[int, int]:
        key = jax.random.key(seed)

        def source(g):
            return g, prompts[g], g * G + np.arange(G), limits[g]

        s = EngineStream(engine, StreamBook(P=P, W=W), n=G, key=key, source=source)
        s.allow(a.steps)
        for step in range(a.steps):
            s.next_batch(lambda v=step: (params, v))
            s.trained()
        return s.kept_tokens, s.slot_steps

    t = time.perf_counter()
    stream(0)
    first_call = time.perf_counter() - t
    waves(0)
    st_t, wave_t = [], []
    for r in range(a.repeats):
        t = time.perf_counter()
        kept, st_steps = stream(r + 1)
        st_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        kept_w, wave_steps = waves(r + 1)
        wave_t.append(time.perf_counter() - t)
    assert kept == kept_w == int(limits.sum()), (kept, kept_w, int(limits.sum()))
    st_s, wave_s = statistics.median(st_t), statistics.median(wave_t)
    print(
        json.dumps(
            {
                "occupancy": round(kept / st_steps, 4),
                "occupancy_wave": round(kept / wave_steps, 4),
                "tokens_per_s": round(kept / st_s, 1),
                "tokens_per_s_wave": round(kept / wave_s, 1),
                "speedup_vs_wave": round(wave_s / st_s, 3),
                "seconds": round(st_s, 3),
                "seconds_wave": round(wave_s, 3),
                "first_call_s": round(first_call, 3),
                "kept_tokens": kept,
                "slots": slots,
                "wave_rows_in_flight": W * P * G,
                "waves": W,
                "prompts": P,
                "samples": G,
                "steps": a.steps,
                "chunk": a.chunk,
                "cap": cap,
                "median_len": float(np.median(limits)),
                "mean_len": round(float(limits.mean()), 1),
                "sigma": a.sigma,
                "preset": a.preset,
                "compiles": engine.compile_counts(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )
    return 0


def _with_chunk(cfg, chunk: int):
    import dataclasses

    return dataclasses.replace(cfg, decode_chunk=chunk)


if __name__ == "__main__":
    sys.exit(main())
