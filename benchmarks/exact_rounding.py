"""What `model.exact_rounding` (XLA's excess precision off) costs in time: the engine's
sampling and the trainer's forward + backward, in bfloat16, with it off and on,
alternating in one process; one JSON object.

    python benchmarks/exact_rounding.py [--preset bench] [--repeats 5] [--platform cpu]
    python benchmarks/exact_rounding.py --ratios    # the importance ratios of a tiny run

Engine: 8 prompts x 8 samples of 8-token prompts, 64 new tokens each (no stop token),
temperature 1 (sampler.py's reference workload, in bfloat16). Trainer: the gradient of
the completions' mean log-prob through the trainer's forward (`completion_forward`,
its compiler options) on those rollouts. Medians of `--repeats` timed runs after one
untimed (compiling) run of each; the load average at the start and the end.

--ratios: `rl-jax train scalerl` in bfloat16 on the trainer tests' tiny run
(tests/_workers/train_even_first.py: its verifier rewards a random policy's rows
unevenly, so every step trains), 4 on-policy steps with the knob off and on; per step
the smallest and largest importance ratio (the trainer's log-prob over the sampler's)
of the update's tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import load_avg  # noqa: E402

from rl_jax.config import ModelConfig, SamplingConfig  # noqa: E402
from rl_jax.models import init_params, resolve_spec  # noqa: E402
from rl_jax.sampling import Engine  # noqa: E402
from rl_jax.sharding import get_rules  # noqa: E402
from rl_jax.train.step import (  # noqa: E402
    compiler_options,
    completion_forward,
    put_batch,
    rollout_arrays,
)


def programs(spec, params, prompts, cfg):
    """(sample(), train()) for `spec`: each runs once and blocks on its result."""
    engine = Engine(spec, cfg, slots=64, chunk=16, pad_id=0)
    out, _ = engine.run(params, prompts, n=8, seed=0)
    host = rollout_arrays(out, out.completion_mask, np.zeros(out.num_rows))
    batch = put_batch(host, None)
    rules = get_rules("fsdp_tp")

    def loss(p, b):
        logp = completion_forward(spec, rules, None, p, b, 1.0)[0]
        return jnp.sum(logp * b.mask) / jnp.sum(b.mask)

    grad = jax.jit(jax.grad(loss), compiler_options=compiler_options(None, spec))

    def sample():
        jax.block_until_ready(engine.run(params, prompts, n=8, seed=0)[0].logprobs)

    def train():
        jax.block_until_ready(grad(params, batch))

    return sample, train


def ratios() -> dict:
    """Per knob setting, each step's (smallest, largest) importance ratio (--ratios)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "_workers"))
    import train_even_first  # registers the run's verifier

    from rl_jax.cli import main as cli

    out = {}
    for exact in ("false", "true"):
        d = Path(tempfile.mkdtemp())
        knobs = ["model.compute_dtype=bfloat16", f"model.exact_rounding={exact}"]
        knobs += ["mesh.num_devices=1", "train.steps=4", "eval.every=4", "eval.at_start=false"]
        args = [*train_even_first.TINY_RUN, *knobs, f"out_dir={d}", "name=r"]
        if cli(["train", "scalerl", *args]) != 0:
            raise SystemExit(f"the run with model.exact_rounding={exact} failed")
        rows = [json.loads(x) for x in (d / "r" / "metrics.jsonl").read_text().splitlines()]
        out[exact] = {
            r["step"]: [r["train/ratio_min"], r["train/ratio_max"]]
            for r in rows
            if "train/ratio_max" in r
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="bench")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--platform", default="cpu")
    p.add_argument("--ratios", action="store_true", help="a tiny run's importance ratios")
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", args.platform)
    if args.ratios:
        print(json.dumps({"ratios": ratios(), "load_avg": load_avg()}))
        return
    load_start = load_avg()
    base = resolve_spec(ModelConfig(preset=args.preset, compute_dtype="bfloat16"))
    params = init_params(base, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, base.vocab_size, 8)) for _ in range(8)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=64, length_bucket=8, max_prompt_len=8)
    runs = {
        exact: programs(base.replace(exact_rounding=exact), params, prompts, cfg)
        for exact in (False, True)
    }
    times: dict = {(exact, part): [] for exact in (False, True) for part in ("sample", "train")}
    for _ in range(args.repeats + 1):  # the first round compiles
        for exact, fns in runs.items():
            for part, fn in zip(("sample", "train"), fns, strict=True):
                t0 = time.perf_counter()
                fn()
                times[exact, part].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    record = {
        "preset": args.preset,
        "platform": jax.devices()[0].platform,
        "sample_s": {"default": med[False, "sample"], "exact": med[True, "sample"]},
        "train_s": {"default": med[False, "train"], "exact": med[True, "train"]},
        "sample_ratio": med[True, "sample"] / med[False, "sample"],
        "train_ratio": med[True, "train"] / med[False, "train"],
        "repeats": args.repeats,
        "load_avg": [load_start, load_avg()],
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
