"""`rl-jax score`: per-token log-probs of a text or of token ids under a model, as JSON.

    rl-jax score --model DIR --text "2+2=4"
    rl-jax score --model DIR --token-ids 1,2,3
prints {"token_ids": [...], "logprobs": [...]}, where logprobs[i] is
log p(token i+1 | tokens 0..i): one fewer than the tokens. `--token-ids` are
scored exactly as given; `--text` is encoded with the tokenizer's special
tokens (a BOS where the tokenizer adds one) unless --no-special-tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rl_jax.cli.sample import parse_ids
from rl_jax.knobs import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rl-jax score", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF directory, GGUF file or rl_jax model dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to score (needs the model's tokenizer)")
    src.add_argument("--token-ids", help="comma-separated token ids, scored as given")
    p.add_argument("--no-special-tokens", action="store_true", help="--text: add no BOS etc.")
    p.add_argument(
        "--chunk", type=int, default=0, help="log-prob chunk over T (0 = none, -1 = auto)"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="divide logits by this")
    p.add_argument(
        "--compute-dtype", default="float32", choices=("float32", "bfloat16"), help="precision"
    )
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise ConfigError(f"--temperature={args.temperature} must be a finite number > 0")
    if args.chunk < -1:
        raise ConfigError(f"--chunk={args.chunk} must be >= -1 (0: none, -1: auto)")
    from rl_jax.config.model import ModelConfig
    from rl_jax.models.load import load_model
    from rl_jax.models.logprobs import score_tokens
    from rl_jax.train.policy_io import is_run_path
    from rl_jax.train.preflight import check_model_files

    if is_run_path(args.model):
        raise ConfigError(
            f"--model {args.model} is a training run; score reads a model: export the run "
            f"first (rl-jax convert {args.model} DIR) and score DIR"
        )
    cfg = ModelConfig(path=args.model, compute_dtype=args.compute_dtype)
    check_model_files(cfg, tokenizer=False)  # a file cut short: named, before loading
    if args.token_ids is not None:
        ids = parse_ids(args.token_ids, "--token-ids")
    else:
        from rl_jax.models.tokenizer import load_tokenizer

        ids = load_tokenizer(args.model).encode(
            args.text, add_special_tokens=not args.no_special_tokens
        )
        if not ids:
            raise ConfigError("--text encodes to no tokens")
    model = load_model(cfg)
    logprobs = score_tokens(model, ids, chunk=args.chunk, temperature=args.temperature)
    json.dump({"token_ids": ids, "logprobs": logprobs}, sys.stdout)
    sys.stdout.write("\n")
    return 0
