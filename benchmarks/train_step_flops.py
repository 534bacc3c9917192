"""The train step's compiled FLOPs on a TPU topology against the model's and the expected
count (model + what remat, blockwise attention and the chunked LM head recompute),
split into what each layer costs and what the rest (embedding, LM head, loss,
optimizer) costs. Compiled from this host (libtpu, no TPU).

    python benchmarks/train_step_flops.py RECIPE --topology v5e:2x2 [key=value ...]

As `rl-jax plan` counts it (`_depth_costs`): the update program built with 1 and 2
layers and one minibatch, the layer scan unrolled (XLA counts a loop's body once),
attention's block pairs and the LM head's chunks peeled (one iteration, plus one
compile per loop with two: a body's cost times its trip count), c(L) = c(1) +
(L - 1) (c(2) - c(1)), times the minibatches. Prints one JSON object; FLOPs and bytes
are per chip.

`--loops` adds, per loop key (name, trip count, inside a layer), one iteration's FLOPs
and bytes as the counting program's stand-in computes them, the bytes per FLOP of the
fused kernel that runs it on the platform (on TPU splash attention, and megablox's
tgmm for a mixture of experts' weight gradient; null where XLA runs the loop itself),
and both over the whole RL step (every layer, every minibatch): where the train step's
bytes come from. Its compiles are the ones the count already makes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from rl_jax.config import load_recipe
from rl_jax.plan._flops import train_flops
from rl_jax.plan._programs import _depth_costs, plan_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--topology", default="v5e:2x2")
    p.add_argument("--loops", action="store_true", help="each loop's share (module doc)")
    args = p.parse_args()
    t0 = time.perf_counter()
    t = plan_target(load_recipe(args.recipe, args.overrides), args.topology)
    cfg, devices, spec, tp, tg = t.cfg, t.devices, t.spec, t.tp, t.tg
    P, G, M = cfg.data.prompts_per_batch, cfg.sampling.n, cfg.train.updates_per_batch
    chips, L = len(devices), spec.num_layers
    bodies: dict = {}
    c1, c2 = _depth_costs(t, spec, ("train_step",), bodies=bodies)
    compiled = [M * float(c["train_step"][0]) for c in (c1, c2)]
    moved = [M * float(c["train_step"][1]) for c in (c1, c2)]
    want = []
    for layers in (1, 2):
        s = dataclasses.replace(spec, num_layers=layers)
        want.append({k: v / chips for k, v in train_flops(s, P, G, tp, tg).items()})

    def split(c1, c2):  # per layer, the rest, and all L layers
        return {"per_layer": c2 - c1, "rest": 2 * c1 - c2, "total": c1 + (L - 1) * (c2 - c1)}

    got = split(*compiled)
    model = split(want[0]["model"], want[1]["model"])
    expected = split(want[0]["expected"], want[1]["expected"])
    out = {
        "topology": args.topology,
        "overrides": args.overrides,
        "compiled": got,
        "bytes": split(*moved),
        **({"loops": _loops(bodies, L, M)} if args.loops else {}),
        "model": model,
        "expected": expected,
        "ratio_model": {k: got[k] / model[k] for k in got},
        "ratio_expected": {k: got[k] / expected[k] for k in got},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))


def _loops(bodies: dict, L: int, M: int) -> list[dict]:
    """Each loop key's iteration and its share of the RL step (`_depth_costs`' bodies)."""
    rows = []
    for (_, (name, n, in_layer)), (body, ratio) in sorted(bodies.items()):
        times = M * n * (L if in_layer else 1)
        flops, stand_in = float(body[0]) * times, float(body[1]) * times
        rows.append(
            {
                "loop": name,
                "trips": n,
                "in_layer": in_layer,
                "body_flops": float(body[0]),
                "body_bytes_stand_in": float(body[1]),
                "kernel_bytes_per_flop": ratio,
                "step_flops": flops,
                "step_bytes_stand_in": stand_in,
                "step_bytes_counted": stand_in if ratio is None else ratio * flops,
            }
        )
    return rows


if __name__ == "__main__":
    main()
