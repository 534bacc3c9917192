"""`rl-jax config RECIPE [key=value ...]`: print the resolved config (every knob left
to its loss's default shown at the value it takes)."""

from __future__ import annotations

import json

from rl_jax.cli import raw_parser
from rl_jax.config import flatten, load_recipe, resolved, run_id, to_dict, to_yaml


def main(argv: list[str]) -> int:
    p = raw_parser("rl-jax config", knobs=True)
    p.add_argument("recipe", help="recipe file or name in experiments/ (e.g. scalerl)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--format", choices=("yaml", "json", "flat"), default="yaml")
    a = p.parse_intermixed_args(argv)
    cfg = resolved(load_recipe(a.recipe, a.overrides))
    if a.format == "yaml":
        print(f"# run_id: {run_id(cfg)}")
        print(to_yaml(cfg), end="")
    elif a.format == "json":
        print(json.dumps({"run_id": run_id(cfg), "config": to_dict(cfg)}, indent=2))
    else:
        for k, v in flatten(cfg).items():
            print(f"{k}={v}")
    return 0
