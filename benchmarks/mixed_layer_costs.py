"""How a plan counts a mixture of experts with dense layers among its sparse ones, against
the whole model's program. Compiled from this host for a TPU topology (libtpu, no TPU).

    python benchmarks/mixed_layer_costs.py [--layers 4] [--dense 0,2] [--topology v5e:2x2]

`rl-jax plan` counts a program's FLOPs and bytes from programs of 1 and 2 layers
(`_layer_costs`): for a mixed model a sparse layer costs the all-sparse 2-layer program's
increment, a dense one the increment of the 2-layer program whose first layer is dense,
and a dense last layer the 2-layer program ending in it less the one starting with it
(a prefill's last layer computes its keys and values only). Here that count is set
against the same programs (one minibatch, loops peeled) compiled with all the layers,
each in its kind. Prints one JSON object: per program and chip,
(FLOPs, bytes) extrapolated and whole, their ratio, and the ratio were every layer
counted as a sparse one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

from rl_jax.config import ModelConfig, load_recipe
from rl_jax.models import build_model, resolve_spec
from rl_jax.models.native import save_model
from rl_jax.plan import _programs as pp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import load_avg  # noqa: E402

RUN = [  # the plan tests' tiny shapes
    "data.prompts_per_batch=4",
    "sampling.n=2",
    "sampling.max_prompt_len=16",
    "sampling.max_new_tokens=16",
    "sampling.engine_slots=4",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=1",
    "model.scan_layers=false",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dense", default="0,2", help="the dense layers, comma-separated ('': none)")
    p.add_argument("--topology", default="v5e:2x2")
    args = p.parse_args()
    dense = tuple(int(i) for i in args.dense.split(",") if i)  # "": all sparse, as a baseline
    cfg = ModelConfig(preset="tiny-moe", num_layers=args.layers, hidden_size=64)
    spec = resolve_spec(cfg).replace(dense_layers=dense)
    path = tempfile.mkdtemp()
    save_model(build_model(spec), path)
    t = pp.plan_target(load_recipe("scalerl", [*RUN, f"model.path={path}"]), args.topology)
    t0, load = time.perf_counter(), load_avg()

    memo: dict = {}

    def peeled(s, layers):  # {program: (FLOPs, bytes)} of `s` built with `layers` layers
        if (s, layers) not in memo:
            c, _ = pp._peeled_costs(t, s, layers, (), pp.PROGRAMS)
            memo[s, layers] = pp._results(c)
        return memo[s, layers]

    # The plan's own count (`_layer_costs`) over its 1- and 2-layer programs taken as
    # peeled as the whole program below is (no loop counts on either side); the recipe
    # runs one minibatch update a batch, as the whole program does.
    pp._depth_costs = lambda t, s, programs: (peeled(s, 1), peeled(s, 2))
    assert t.cfg.train.updates_per_batch == 1
    counted = pp._layer_costs(t)
    naive = pp._layer_costs(dataclasses.replace(t, spec=t.spec.replace(dense_layers=())))
    whole = peeled(t.spec, args.layers)
    out = {}
    for n, c in counted.items():
        out[n] = {
            "extrapolated": list(c),
            "whole": whole[n].tolist(),
            "ratio": (np.asarray(c) / whole[n]).round(4).tolist(),
            # every layer counted as a sparse one
            "ratio_all_sparse": (np.asarray(naive[n]) / whole[n]).round(4).tolist(),
        }
    record = dict(
        layers=args.layers,
        dense=list(dense),
        topology=args.topology,
        programs=out,
        seconds=round(time.perf_counter() - t0, 1),
        load_avg=[load, load_avg()],
    )
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
