"""`rl-jax sample`: completions from a model, as text or one JSON object per row.

    rl-jax sample --model DIR --prompt "2+2=" sampling.n=4 sampling.temperature=0.6
    rl-jax sample --model DIR --prompts prompts.txt --json
    rl-jax sample --model DIR --prompt-token-ids 1,2,3 sampling.temperature=0

--model: an HF directory, a GGUF file or an rl_jax model directory (tokenizer
files beside the weights are used for text), or a training run: RUN (its newest
checkpoint that verifies, or --step N) or RUN/checkpoints/STEP, sampled as the run
sampled: its tokenizer, its sampling.* settings (samples per prompt, max_new_tokens,
temperature, top_p, top_k, stop tokens, forced interruptions) and the way it rendered
a question (data.chat_template, data.system_prompt, data.answer_instruction), each
overridable here (sampling.max_new_tokens=64, data.chat_template=false, --chat); the
settings used are printed on stderr. A run's model.*, train.*, loss.* and lora.* are
its policy, not overridable.
--prompts FILE: one prompt per line, or JSON lines with "prompt" (text) or
"token_ids". Text prompts are rendered as a user message with the tokenizer's chat
template when it ships one (data.chat_template=false: plain text; data.system_prompt:
a system message; --chat: insist on a template) and encoded without special tokens;
token ids are used as given. With --json each row prints
{"prompt_index", "sample_index", "token_ids" (completion only), "logprobs",
"finish_reason", "truncated", "length", "text"}. Log-probs are of the
temperature-scaled distribution sampled from (temperature 1 for greedy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rl_jax.cli import raw_parser
from rl_jax.knobs import INT_MAX, INT_MIN, ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = raw_parser("rl-jax sample", *__doc__.split("\n\n", 1))
    p.add_argument(
        "--model",
        required=True,
        help="HF directory, GGUF file, rl_jax model dir, or a run (RUN, RUN/checkpoints/STEP)",
    )
    p.add_argument("--step", type=int, default=None, help="with a run: its checkpoint step")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one text prompt")
    src.add_argument("--prompts", help="file: a prompt per line, or JSON lines")
    src.add_argument("--prompt-token-ids", help="one prompt as comma-separated token ids")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "--chat",
        action="store_true",
        help="require the chat template (text prompts use it by default when the tokenizer "
        "has one; data.chat_template=false turns it off)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides (sampling.*, model.*)"
    )
    return p


def parse_ids(text: str, where: str = "--prompt-token-ids") -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"{where}={text!r} must be comma-separated integers") from None
    if not ids:
        raise ConfigError(f"{where} is empty")
    return ids


def check_vocab(prompts: list[list[int]], vocab: int) -> None:
    """Every prompt's token ids within [0, vocab): an id outside would be clamped by the
    embedding lookup and sampled from silently."""
    for n, ids in enumerate(prompts):
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ConfigError(
                f"prompt {n}: token ids {bad[:5]} are outside the model's vocabulary [0, {vocab})"
            )


def read_prompts(path: str) -> list[str | list[int]]:
    """Text prompts or token-id lists from a file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    out: list[str | list[int]] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if "token_ids" in obj:
                out.append([int(t) for t in obj["token_ids"]])
            elif "prompt" in obj:
                out.append(str(obj["prompt"]))
            else:
                raise ConfigError(f"{path}:{n}: a JSON line needs 'prompt' or 'token_ids'")
        else:
            out.append(line)
    if not out:
        raise ConfigError(f"--prompts {path} holds no prompts")
    return out


def _tokenizer(model_path: str):
    """The model's tokenizer; None if it ships none (a damaged one is an error)."""
    from rl_jax.models.load import local_model_path
    from rl_jax.models.tokenizer import load_tokenizer

    p = local_model_path(model_path, weights=False)  # a URL's tokenizer files, copied here
    if p.is_dir() and not (p / "tokenizer.json").is_file():
        return None
    try:
        return load_tokenizer(p)
    except (OSError, ValueError):
        if p.is_dir():  # a tokenizer.json that does not load is damaged, not absent
            raise
        return None  # a GGUF file whose tokenizer kind is not supported: token ids only


# Overrides that would change a run's policy rather than how it is sampled: refused with
# a run as --model (rl-jax eval refuses them too).
_FIXED = ("model.", "train.", "loss.", "lora.")


def sampling_config(args):
    """(RunConfig, the run's checkpoint or None): a run's own config under --model RUN
    (its sampling, chat-template choice, system prompt), else the defaults; the
    command's overrides on top."""
    from rl_jax.config import RunConfig, apply_overrides
    from rl_jax.train.policy_io import find_run_checkpoint, is_run_path

    run_ck = find_run_checkpoint(args.model, args.step) if is_run_path(args.model) else None
    if run_ck is None:
        if args.step is not None:
            raise ConfigError(f"--step needs a run directory as --model, not {args.model}")
        return apply_overrides(RunConfig(), args.overrides), None
    bad = [o for o in args.overrides if o.split("=", 1)[0].startswith(_FIXED)]
    if bad:
        raise ConfigError(
            f"{bad}: a run is sampled as it was trained; its model.*, train.*, loss.* and "
            "lora.* define the policy (convert it to a model directory to change them)"
        )
    return apply_overrides(run_ck.cfg, args.overrides), run_ck


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not INT_MIN <= args.seed <= INT_MAX:
        raise ConfigError(f"--seed={args.seed} must fit a 64-bit integer")
    cfg, run_ck = sampling_config(args)
    model_cfg = dataclasses.replace(cfg.model, path=args.model, preset="")
    scfg = cfg.sampling

    if args.prompt_token_ids is not None:
        raw: list[str | list[int]] = [parse_ids(args.prompt_token_ids)]
    elif args.prompt is not None:
        raw = [args.prompt]
    else:
        raw = read_prompts(args.prompts)
    tok = _run_or_model_tokenizer(args, run_ck, model_cfg)
    prompts = _prompt_ids(args, cfg, tok, raw)

    from rl_jax.sampling import Engine

    model = _load(args, cfg, run_ck, model_cfg)
    spec = model.spec
    check_vocab(prompts, spec.vocab_size)
    if tok is not None:
        eos, pad = tok.eos_id, tok.pad_id
    else:
        eos = list(spec.eos_token_ids) or None
        pad = spec.pad_token_id if spec.pad_token_id >= 0 else 0
    interrupt_ids = tok.encode(scfg.interrupt_text) if scfg.length_control == "interrupt" else None
    longest = max(len(p) for p in prompts)
    if longest > scfg.max_prompt_len:
        # One-off use: let the prompt decide rather than fail on the training default.
        scfg = dataclasses.replace(scfg, max_prompt_len=longest)
    engine = Engine.for_batch(
        spec,
        scfg,
        prompts=len(prompts),
        prompt_len=longest,
        eos_id=eos,
        pad_id=pad,
        interrupt_ids=interrupt_ids,
    )
    out, _ = engine.run(model, prompts, seed=args.seed)
    _print_samples(out, tok, n=scfg.n, as_json=args.json)
    return 0


def _run_or_model_tokenizer(args, run_ck, model_cfg):
    """The run's tokenizer, or --model's (None where it ships none)."""
    if run_ck is not None:
        from rl_jax.train.policy_io import run_tokenizer

        return run_tokenizer(run_ck)
    from rl_jax.train.preflight import check_model_files

    check_model_files(model_cfg, tokenizer=False)
    return _tokenizer(args.model)


def _prompt_ids(args, cfg, tok, raw: list) -> list[list[int]]:
    """Each prompt's token ids: ids as given, text rendered (data.prompt_template, the chat
    template with --chat) and encoded."""
    scfg = cfg.sampling
    needs_text = any(isinstance(r, str) for r in raw) or scfg.length_control == "interrupt"
    if needs_text and tok is None:
        raise ConfigError(
            f"--model {args.model} has no tokenizer files; pass --prompt-token-ids "
            "(and no sampling.length_control=interrupt)"
        )
    if args.chat and tok is not None and not getattr(tok, "chat_template", None):
        raise ConfigError(f"--chat: the tokenizer of {args.model} has no chat template")
    from rl_jax.data import prompt_renderer

    verifier = "" if cfg.rewards.name == "auto" else cfg.rewards.name
    render = prompt_renderer(
        dataclasses.replace(cfg.data, chat_template=cfg.data.chat_template or args.chat),
        tok,
        verifier=verifier,
    )
    prompts = []
    for r in raw:
        prompts.append(r if isinstance(r, list) else tok.encode(render(r)))
        if not prompts[-1]:
            raise ConfigError(f"prompt {len(prompts) - 1} encodes to no tokens")
    return prompts


def _load(args, cfg, run_ck, model_cfg):
    """The run's policy (saying which, with its sampling settings) or --model's weights."""
    from rl_jax.models.load import load_model

    if run_ck is None:
        return load_model(model_cfg, purpose="sample")
    from rl_jax.train.policy_io import load_run_model

    scfg = cfg.sampling
    model, run_ck = load_run_model(run_ck, purpose="sample")
    print(
        f"sampling run {run_ck.name} step {run_ck.step} with its settings: "
        f"max_new_tokens={scfg.max_new_tokens} temperature={scfg.temperature:g} "
        f"top_p={scfg.top_p:g} top_k={scfg.top_k} chat template "
        f"{'on' if cfg.data.chat_template or args.chat else 'off'}",
        file=sys.stderr,
        flush=True,
    )
    return model


def _print_samples(out, tok, *, n: int, as_json: bool) -> None:
    """Every row: a JSON line (ids, log-probs, finish reason, text), or a header and its text."""
    names = out.finish_names
    for r in range(out.num_rows):
        ids = out.completion(r)
        text = None if tok is None else tok.decode(ids)
        if as_json:
            row = {
                "prompt_index": int(out.group_ids[r]),
                "sample_index": r % n,
                "token_ids": ids,
                "logprobs": [float(x) for x in out.logprobs[r, : len(ids)]],
                "finish_reason": names[r],
                "truncated": bool(out.truncated[r]),
                "length": len(ids),
                "text": text,
            }
            print(json.dumps(row))
        else:
            shown = text if text is not None else " ".join(map(str, ids))
            print(f"--- prompt {int(out.group_ids[r])} sample {r % n} ({names[r]})")
            print(shown)
    sys.stdout.flush()
