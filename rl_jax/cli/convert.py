"""`rl-jax convert SRC OUT`: move a model between HF, GGUF and rl_jax formats.

    rl-jax convert hf_dir out_dir                 # HF -> rl_jax model directory
    rl-jax convert rl_jax_dir out_dir             # rl_jax -> HF (transformers loads it)
    rl-jax convert model.gguf out_dir             # GGUF -> HF (dequantized, tokenizer too)
    rl-jax convert runs/NAME out_dir              # a run's newest checkpoint -> HF
    rl-jax convert runs/NAME/checkpoints/40 out_dir --to rl_jax
    rl-jax convert SRC OUT --to hf|rl_jax --dtype bfloat16

The default target is the other family: rl_jax for an HF source, HF otherwise.
Tokenizer files travel along (from a GGUF file, a tokenizer.json is built; from a
run, the tokenizer it trained with: its model.path's files, or the built-in
character tokenizer written as an HF tokenizer with the same ids).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rl_jax.knobs import ConfigError

TARGETS = ("hf", "rl_jax")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rl-jax convert",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "src",
        help="HF directory, GGUF file, rl_jax model directory, or a run (RUN[/checkpoints/STEP])",
    )
    p.add_argument("--step", type=int, default=None, help="with a run: its checkpoint step")
    p.add_argument("out", help="output directory")
    p.add_argument("--to", choices=TARGETS, default=None, help="target format")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="parameter dtype of the output",
    )
    p.add_argument(
        "--max-shard-gb", type=float, default=4.0, help="HF output: split files above this size"
    )
    return p


def source_kind(src: Path) -> str:
    from rl_jax.models.native import is_native_dir
    from rl_jax.train.policy_io import is_run_path

    if is_run_path(src):
        return "run"
    if src.suffix == ".gguf" and src.is_file():
        return "gguf"
    if is_native_dir(src):
        return "rl_jax"
    if (src / "config.json").is_file():
        return "hf"
    raise ConfigError(
        f"{src} is neither an HF directory, a GGUF file, an rl_jax model directory nor a "
        "training run (RUN, RUN/checkpoints/STEP)"
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from rl_jax.config.model import ModelConfig
    from rl_jax.models.hf import export_hf
    from rl_jax.models.load import load_model, local_model_path
    from rl_jax.models.native import save_model

    src, out = Path(args.src), Path(args.out)
    kind = source_kind(src)
    target = args.to or ("rl_jax" if kind == "hf" else "hf")
    if out.resolve() == src.resolve():
        raise ConfigError(f"output {out} is the source itself; pick another directory")
    if args.step is not None and kind != "run":
        raise ConfigError(f"--step needs a run directory as the source, not {src}")
    tokenizer_from = src if src.is_dir() else None
    write_tokenizer = None
    if kind == "run":
        from rl_jax.train.policy_io import load_run_model, run_tokenizer

        model, ck = load_run_model(src, step=args.step, param_dtype=args.dtype)
        # The run's model.path may be a URL: its tokenizer files come from the input cache.
        path = ck.cfg.model.path
        tokenizer_from = local_model_path(path, weights=False) if path else None
        if not tokenizer_from:  # the built-in character tokenizer
            write_tokenizer = run_tokenizer(ck).save
    else:
        model = load_model(ModelConfig(path=str(src), param_dtype=args.dtype))
    if target == "hf":
        export_hf(
            model,
            out,
            tokenizer_from=tokenizer_from,
            max_shard_bytes=int(args.max_shard_gb * (1 << 30)),
        )
    else:
        save_model(model, out, tokenizer_from=tokenizer_from)
    if write_tokenizer is not None:
        write_tokenizer(out)
    if kind == "gguf":
        from rl_jax.models.tokenizer import HFTokenizer

        try:
            HFTokenizer.from_gguf(src).save(out)
        except ConfigError as e:
            print(f"rl-jax convert: weights written; tokenizer not converted: {e}", file=sys.stderr)
    summary = {
        "from": kind,
        **({"step": ck.step} if kind == "run" else {}),
        "to": target,
        "out": str(out),
        "architecture": model.spec.architecture,
        "params": model.spec.num_params(),
        "dtype": args.dtype,
    }
    print(json.dumps(summary))
    return 0
