"""`rl-jax convert SRC OUT`: move a model between HF, GGUF and rl_jax formats.

    rl-jax convert hf_dir out_dir                 # HF -> rl_jax model directory
    rl-jax convert rl_jax_dir out_dir             # rl_jax -> HF (transformers loads it)
    rl-jax convert model.gguf out_dir             # GGUF -> HF (dequantized, tokenizer too)
    rl-jax convert runs/NAME out_dir              # a run's newest checkpoint -> HF
    rl-jax convert runs/NAME/checkpoints/40 out_dir --to rl_jax
    rl-jax convert SRC OUT --to hf|rl_jax --dtype bfloat16

The default target is the other family: rl_jax for an HF source, HF otherwise.
The tokenizer travels along, so transformers' AutoTokenizer loads the output: an
HF or rl_jax source's tokenizer files as they are; from a GGUF file, a tokenizer.json
built from its vocabulary, merges and chat template; from a run, the tokenizer it
trained with (its model.path's, or the built-in character tokenizer as an HF
tokenizer of the same ids), with its chat template only if the run prompted with
it (data.chat_template). The output also gets a generation_config.json: the
model's BOS / EOS / pad ids, the tokens generation stops at first among the EOS ids,
and from a run its sampling settings (temperature, top_p, top_k, max_new_tokens).

A run's checkpoint is verified against its checksums: a damaged step asked for is
refused (exit 2, naming the array); the newest step, unasked, falls back to the
newest one that verifies (and says so).

OUT is a new or empty directory, or a previous export of the same kind, whose files
are replaced; a directory holding anything else is refused unless --force (then the
files an export writes are replaced, and the others kept).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_jax.cli import raw_parser
from rl_jax.config.paths import check_dir_path
from rl_jax.knobs import ConfigError

TARGETS = ("hf", "rl_jax")


def build_parser() -> argparse.ArgumentParser:
    p = raw_parser("rl-jax convert", *__doc__.split("\n\n", 1))
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
    p.add_argument(
        "--force",
        action="store_true",
        help="write into OUT although it holds files other than a previous export",
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


def export_files(target: str) -> tuple[str, ...]:
    """Names (globs) of the files an export of `target` writes."""
    from rl_jax.models.hf import TOKENIZER_FILES
    from rl_jax.models.native import PARAMS_FILE, SPEC_FILE

    weights = (
        ("config.json", "model.safetensors", "model-*-of-*.safetensors")
        + ("model.safetensors.index.json",)
        if target == "hf"
        else (SPEC_FILE, PARAMS_FILE)
    )
    return (*weights, "generation_config.json", *TOKENIZER_FILES)


def _is_export_file(p: Path, target: str) -> bool:
    return p.is_file() and any(p.match(g) for g in export_files(target))


def _is_export(out: Path, target: str) -> bool:
    from rl_jax.models.native import is_native_dir

    if target == "rl_jax":
        return is_native_dir(out)
    from rl_jax.models.hf import ARCH_BY_CLASS, read_hf_config

    try:
        classes = read_hf_config(out).get("architectures") or []
    except ConfigError:
        return False
    return any(c in ARCH_BY_CLASS for c in classes)


def check_output_dir(out: Path, target: str, *, force: bool) -> None:
    """OUT may be new, empty, a previous export of `target`, or anything with --force."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output {out} is a file; convert writes a directory")
    check_dir_path(out, "output")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    others = [e.name for e in entries if not _is_export_file(e, target)]
    if not entries or force or (not others and _is_export(out, target)):
        return
    shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
    raise ConfigError(
        f"output directory {out} is not empty and is not a previous {target} export (it "
        f"holds {shown or 'another model'}); pick a new or empty directory, or pass --force "
        "to write into it (the files an export writes are replaced, the others kept)"
    )


def clear_previous_export(out: Path, target: str) -> None:
    """Remove the files a previous export left in `out` (shards, a tokenizer, ...), so the
    new export never mixes with them."""
    if out.is_dir():
        for e in out.iterdir():
            if _is_export_file(e, target):
                e.unlink()


@dataclass(frozen=True)
class Extras:
    """What travels with the weights: the tokenizer (an object, or a directory whose
    files are copied), whether its chat template does, and the generation settings."""

    tokenizer: Any = None
    files_from: Path | None = None  # a directory whose tokenizer files are copied
    chat_template: bool = True
    generation: dict = field(default_factory=dict)  # the source's generation_config.json
    stop_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None or self.files_from is not None


def source_extras(kind: str, src: Path) -> Extras:
    """The tokenizer of an HF / rl_jax directory or a GGUF file (read before any weight)."""
    from rl_jax.models.hf import has_tokenizer_files, read_generation_config

    if kind == "gguf":
        from rl_jax.models.tokenizer import HFTokenizer

        try:
            return Extras(tokenizer=HFTokenizer.from_gguf(src))
        except ConfigError as e:
            print(f"rl-jax convert: the tokenizer is not converted: {e}", file=sys.stderr)
            return Extras()
    if not has_tokenizer_files(src):
        print(f"rl-jax convert: {src} has no tokenizer files; the output has none", file=sys.stderr)
        return Extras(generation=read_generation_config(src))
    tok = None
    if (src / "tokenizer.json").is_file():  # else a slow tokenizer's files, copied as they are
        from rl_jax.models.tokenizer import load_tokenizer

        tok = load_tokenizer(src)
    return Extras(tokenizer=tok, files_from=src, generation=read_generation_config(src))


def run_extras(ck) -> Extras:
    """The tokenizer a run trained with, its chat-template choice, the tokens its
    generation stopped at and its sampling settings (as GenerationConfig fields)."""
    from rl_jax.models.hf import read_generation_config
    from rl_jax.models.load import local_model_path
    from rl_jax.train.policy_io import run_tokenizer

    tok = run_tokenizer(ck)
    path = ck.cfg.model.path
    # A URL's tokenizer files come from the local input cache.
    local = local_model_path(path, weights=False) if path else None
    model_dir = local if local is not None and local.is_dir() else None
    s = ck.cfg.sampling
    sampling = {"do_sample": s.temperature > 0, "max_new_tokens": s.max_new_tokens}
    if s.temperature > 0:
        sampling.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    return Extras(
        tokenizer=tok,
        files_from=model_dir,
        chat_template=ck.cfg.data.chat_template,
        generation=read_generation_config(model_dir),
        stop_ids=tuple(s.stop_token_ids) or (tok.eos_id,),
        sampling=sampling,
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from rl_jax.config.model import ModelConfig

    src, out = Path(args.src), Path(args.out)
    kind = source_kind(src)
    target = args.to or ("rl_jax" if kind == "hf" else "hf")
    if out.resolve() == src.resolve():
        raise ConfigError(f"output {out} is the source itself; pick another directory")
    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
        raise ConfigError(f"--max-shard-gb={args.max_shard_gb} must be a finite number > 0")
    if args.step is not None and kind != "run":
        raise ConfigError(f"--step needs a run directory as the source, not {src}")
    check_output_dir(out, target, force=args.force)
    ck = None
    if kind == "run":
        from rl_jax.train.policy_io import find_run_checkpoint, load_run_model

        ck = find_run_checkpoint(src, args.step)
        extras = run_extras(ck)  # the tokenizer read before any weight
        model, ck = load_run_model(ck, param_dtype=args.dtype)
    else:
        from rl_jax.models.load import load_model
        from rl_jax.train.preflight import check_model_files

        cfg = ModelConfig(path=str(src), param_dtype=args.dtype)
        check_model_files(cfg, tokenizer=False)  # a file cut short: named, before loading
        extras = source_extras(kind, src)
        model = load_model(cfg)
    write_export(model, out, target, extras, max_shard_bytes=int(args.max_shard_gb * (1 << 30)))
    summary = {
        "from": kind,
        **({"step": ck.step} if ck is not None else {}),
        "to": target,
        "out": str(out),
        "architecture": model.spec.architecture,
        "params": model.spec.num_params(),
        "dtype": args.dtype,
        "tokenizer": extras.has_tokenizer,
    }
    print(json.dumps(summary))
    return 0


def write_export(model, out: Path, target: str, extras: Extras, *, max_shard_bytes: int) -> None:
    """The weights, the tokenizer and generation_config.json, over any previous export."""
    from rl_jax.models.hf import export_hf, with_token_ids, write_generation_config
    from rl_jax.models.native import save_model
    from rl_jax.models.tokenizer import export_tokenizer

    clear_previous_export(out, target)
    spec = with_token_ids(model.spec, extras.tokenizer)
    if target == "hf":
        export_hf(model, out, max_shard_bytes=max_shard_bytes, spec=spec)
    else:
        save_model(model, out)
    if extras.has_tokenizer:
        export_tokenizer(
            out,
            extras.tokenizer,
            files_from=extras.files_from,
            chat_template=extras.chat_template,
        )
    write_generation_config(
        out,
        spec,
        stop_ids=extras.stop_ids,
        base=extras.generation,
        sampling=extras.sampling,
    )
