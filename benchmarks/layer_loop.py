"""The layer loop rolled (`model.scan_layers=true`, one `lax.scan`) against unrolled
(`false`): the gradient of a batch's completion log-probs, the train step's forward and
backward, on a preset's model. One JSON line.

    python benchmarks/layer_loop.py [--preset bench] [--rows 64] [--tokens 72]
        [--repeats 12] [--topology v5e:2x2] [--smoke]

On this machine's CPU: both programs compiled, then timed alternately (`--repeats`
calls each, one at a time), with their compile seconds and XLA's temporaries.
`--topology`: also compiled by libtpu for that TPU topology's first chip, from this
host (no TPU), reporting its temporaries (a rolled loop's FLOPs and bytes count one
iteration there, so they are left out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import load_avg, median  # noqa: E402


def _grad_fn(spec, rows: int, tokens: int):
    import jax
    import jax.numpy as jnp

    from rl_jax.models import Transformer, token_logprobs

    toks = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)

    def loss(params, t):
        lp, ent = token_logprobs(Transformer(spec, params), t)
        return lp.sum() + 0.01 * ent.sum()

    return jax.jit(jax.value_and_grad(loss)), toks


def _programs(preset: str):
    from rl_jax.config.model import ModelConfig
    from rl_jax.models import resolve_spec

    base = resolve_spec(ModelConfig(preset=preset))
    return {
        name: dataclasses.replace(base, scan_layers=rolled)
        for name, rolled in (("rolled", True), ("unrolled", False))
    }


def _cpu(specs: dict, rows: int, tokens: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from rl_jax.models import init_params

    out, calls = {}, {}
    toks = np.random.default_rng(0).integers(0, 100, (rows, tokens)).astype(np.int32)
    for name, spec in specs.items():
        params = init_params(spec, jax.random.key(0))
        fn, abstract = _grad_fn(spec, rows, tokens)
        t = time.perf_counter()
        compiled = fn.lower(params, abstract).compile()
        out[name] = {
            "compile_s": round(time.perf_counter() - t, 2),
            "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 1),
            "times": [],
        }
        jax.block_until_ready(compiled(params, toks))
        calls[name] = (compiled, params)
    for _ in range(repeats):
        for name, (compiled, params) in calls.items():
            t = time.perf_counter()
            jax.block_until_ready(compiled(params, toks))
            out[name]["times"].append(time.perf_counter() - t)
    for rec in out.values():
        times = rec.pop("times")
        rec.update(median_s=round(median(times), 6), min_s=round(min(times), 6))
    return out


def _tpu(specs: dict, rows: int, tokens: int, topology: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from rl_jax.models import param_layout
    from rl_jax.plan._programs import topology_devices

    mesh = Mesh(np.array(topology_devices(topology)[:1]), ("d",))
    rep = NamedSharding(mesh, P())
    out = {}
    for name, spec in specs.items():
        fn, toks = _grad_fn(spec, rows, tokens)
        params = {
            n: jax.ShapeDtypeStruct(info.shape, spec.param_dtype, sharding=rep)
            for n, info in param_layout(spec).items()
        }
        toks = jax.ShapeDtypeStruct(toks.shape, toks.dtype, sharding=rep)
        t = time.perf_counter()
        compiled = fn.lower(params, toks).compile()
        out[name] = {
            "compile_s": round(time.perf_counter() - t, 2),
            "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 1),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=72)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--topology", default="", help="also compile for this TPU topology")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one call each (tests)")
    a = p.parse_args()
    if a.smoke:  # tests: the tiny preset, a few rows, one call each
        a.preset, a.rows, a.tokens, a.repeats = "tiny", 4, 8, 1
    specs = _programs(a.preset)
    rec = {
        "preset": a.preset,
        "layers": specs["rolled"].num_layers,
        "rows": a.rows,
        "tokens": a.tokens,
        "load_avg_1m": load_avg(),
        "cpu": _cpu(specs, a.rows, a.tokens, a.repeats),
    }
    cpu = rec["cpu"]
    rec["rolled_over_unrolled"] = round(cpu["rolled"]["min_s"] / cpu["unrolled"]["min_s"], 3)
    if a.topology:
        rec["tpu"] = {"topology": a.topology, **_tpu(specs, a.rows, a.tokens, a.topology)}
    rec["load_avg_1m_end"] = load_avg()
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
