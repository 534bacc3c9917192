"""The engine's prefill_insert on PipelineRL's stream as the demo builds it, its prefill
whole against in blocks; one JSON line.

The `scalerl` recipe's engine (PipelineRL-8: W x B_p x n = 9 x 16 x 8 = 1,152 slots,
prefill_prompts = W x B_p = 144, `evaluation.PREFILL_BLOCK` = 16 prompts a block),
tiny model, one device: the median wall time of a prefill_insert that brings --few
new prompts (a refill of a batch's groups) and one that brings all 144, with the
prefill computed whole (every one of the 144 prompt rows) and in blocks (only the
blocks new prompts fill). Each new prompt's 8 rows go into slots, as a refill does.

    python benchmarks/prefill_blocks.py [--few 16] [--repeats 5]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--few", type=int, default=16, help="new prompts of a small refill")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    import jax

    from rl_jax.config import load_recipe, resolved
    from rl_jax.models import init_params, resolve_spec
    from rl_jax.sampling import Engine
    from rl_jax.train.accounting import sampler_rows
    from rl_jax.train.evaluation import engine_shape
    from rl_jax.train.parts import engine_sampling

    cfg = resolved(load_recipe("scalerl", ["sampling.max_prompt_len=16"]))
    spec = resolve_spec(cfg.model)
    params = init_params(spec, jax.random.key(0))
    sampling = engine_sampling(cfg)
    shape = engine_shape(sampling, rows=sampler_rows(cfg), shards=1)
    G, key = sampling.n, jax.random.key(1)
    result = {"shape": shape}
    for name, block in (("whole", None), ("blocks", shape["prefill_block"])):
        engine = Engine(
            spec,
            sampling,
            prompt_len=16,
            fixed_shapes=True,
            pad_id=0,
            eos_id=1,
            interrupt_ids=[2],
            **{**shape, "prefill_block": block},
        )
        for new in (a.few, shape["prefill_prompts"]):
            state, times = engine.init(), []
            rows = min(new * G, engine.slots)
            slots = list(range(rows))
            sources = [i // G for i in range(rows)]
            for _ in range(a.repeats + 1):  # the first call compiles
                t = time.perf_counter()
                state = engine.prefill_insert(
                    params,
                    state,
                    [[3, 4, 5, 6, 7]] * new,
                    list(range(new)),
                    slots,
                    sources,
                    slots,
                    sources,
                    key=key,
                )
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t)
            result[f"{name}_{new}_ms"] = round(1e3 * statistics.median(times[1:]), 2)
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
