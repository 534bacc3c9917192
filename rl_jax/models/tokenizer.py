"""Tokenizers of real checkpoints, behind the protocol every rl_jax tokenizer speaks:

    encode(text) -> list[int]      decode(ids) -> str
    eos_id, pad_id, bos_id, vocab_size
    apply_chat_template(messages) -> str

`HFTokenizer.from_dir` reads `tokenizer.json` with the `tokenizers` library and
the special tokens / chat template from `tokenizer_config.json` (or
`chat_template.jinja`, where transformers 5 writes it). `HFTokenizer.from_gguf`
builds the byte-level BPE a GGUF file describes. Chat templates are rendered
with jinja2 in a sandbox, the way transformers renders them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from rl_jax.knobs import ConfigError, read_json_object


def _token_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return str(value)


class HFTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        source: str = "tokenizer",
    ):
        self.tokenizer = tokenizer
        self.source = source
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.chat_template = chat_template

        def tid(tok):
            return None if tok is None else tokenizer.token_to_id(tok)

        self.bos_id: int | None = tid(bos_token)
        eos = tid(eos_token)
        if eos is None:
            raise ConfigError(
                f"{source}: no EOS token (eos_token={eos_token!r} is not in the vocab)"
            )
        self.eos_id: int = eos
        pad = tid(pad_token)
        # No pad token (common for base models): pad with EOS; pads are masked anyway.
        self.pad_id: int = eos if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. No BOS by default: chat templates write their own."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Prompt text for `messages` ([{"role": ..., "content": ...}]) by the model's template."""
        if not self.chat_template:
            raise ConfigError(
                f"{self.source} has no chat template (tokenizer_config.json 'chat_template' "
                "or chat_template.jinja); format prompts as plain text instead"
            )
        return _render(
            self.chat_template,
            self.source,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ConfigError(
                f"{path}: no tokenizer.json (only fast-tokenizer files are read; "
                "re-save the tokenizer with transformers to produce one)"
            )
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exception
            raise ConfigError(f"{tj}: not a readable tokenizer.json ({_first_line(e)})") from None
        cfg: dict[str, Any] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if (path / name).is_file():
                cfg.update(read_json_object(path / name))
        template = _chat_template(path, cfg)
        eos = _token_text(cfg.get("eos_token"))
        if eos is None:
            eos = _eos_from_generation_config(path, tok)
        return cls(
            tok,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=eos,
            pad_token=_token_text(cfg.get("pad_token")),
            chat_template=template,
            source=str(path),
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> HFTokenizer:
        """The byte-level BPE (tokenizer.ggml.model == 'gpt2') stored in a GGUF file."""
        from rl_jax.models.gguf_io import read_gguf

        m = read_gguf(path).metadata
        kind = m.get("tokenizer.ggml.model")
        pre = m.get("tokenizer.ggml.pre", "default")
        # Pre-tokenizers whose split is GPT-2's own; others (llama3, qwen2, ...) split
        # text differently and would give different ids.
        if kind != "gpt2" or pre not in ("default", "gpt-2", "smollm"):
            raise ConfigError(
                f"{path}: GGUF tokenizer model={kind!r} pre={pre!r} is not supported "
                "(supported: byte-level BPE with the GPT-2 split); use an HF directory"
            )
        try:
            tok, special = _gguf_bpe(m)
        except KeyError as e:
            raise ConfigError(f"{path}: GGUF tokenizer metadata lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: GGUF tokenizer metadata: {_first_line(e)}") from None
        template = m.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ConfigError(f"{path}: GGUF tokenizer.chat_template={template!r} is not a string")
        if template:
            _environment(template, Path(path))
        return cls(
            tok,
            bos_token=special["bos"],
            eos_token=special["eos"],
            pad_token=special["pad"],
            chat_template=template,
            source=str(path),
        )

    def save(self, out_dir: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json (special tokens, chat template)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(out / "tokenizer.json"))
        cfg = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def export_tokenizer(
    out_dir: str | Path,
    tokenizer: Any,
    *,
    files_from: str | Path | None = None,
    chat_template: bool = True,
) -> None:
    """Write a model's tokenizer into `out_dir` as transformers' AutoTokenizer reads it.

    files_from: a model directory whose tokenizer files (rl_jax.models.hf.TOKENIZER_FILES)
    are copied as they are; else `tokenizer.save(out_dir)` (an HFTokenizer, e.g. one built
    from a GGUF file, or the character tokenizer). chat_template=False leaves the chat template out
    (a run that prompted its model with plain text): the exported tokenizer is then
    prompted as the model was trained."""
    from rl_jax.models.hf import copy_tokenizer_files, has_tokenizer_files

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if files_from is not None and has_tokenizer_files(files_from):
        copy_tokenizer_files(files_from, out)
    else:
        tokenizer.save(out)
    if not chat_template:
        for f in ("chat_template.jinja", "chat_template.json"):
            (out / f).unlink(missing_ok=True)
        cfg_file = out / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = read_json_object(cfg_file)
            if cfg.pop("chat_template", None) is not None:
                cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """From an HF directory or a GGUF file, local or a URL (its tokenizer files copied into
    the local input cache: rl_jax.models.load.local_model_path)."""
    from rl_jax.models.load import local_model_path

    p = local_model_path(path, weights=False)
    return HFTokenizer.from_gguf(p) if p.suffix == ".gguf" else HFTokenizer.from_dir(p)


def _gguf_bpe(m: dict[str, Any]):
    """The byte-level BPE of GGUF metadata `m`, and its bos / eos / pad tokens (text; None: no
    id, or one outside the vocab). Damaged metadata raises KeyError / TypeError
    / ValueError for `HFTokenizer.from_gguf` to name."""
    tokens = m["tokenizer.ggml.tokens"]
    merges = [tuple(x.split(" ", 1)) for x in m["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = m.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]  # CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def at(key):
        i = m.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    return tok, {
        name: at(key) for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }


def _chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    """The chat template of directory `path` (tokenizer settings `cfg`): chat_template.jinja,
    else chat_template.json, else tokenizer_config.json's. Checked to parse, so a broken one
    is a ConfigError naming its file when the tokenizer is read, not when prompting."""
    if (path / "chat_template.jinja").is_file():
        f = path / "chat_template.jinja"
        try:
            template = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{f}: not UTF-8 text ({e})") from None
    elif (path / "chat_template.json").is_file():
        f = path / "chat_template.json"
        template = _named_template(read_json_object(f).get("chat_template"), f)
    else:
        f = path / "tokenizer_config.json"
        template = _named_template(cfg.get("chat_template"), f)
    if template:
        _environment(template, f)
    return template


def _named_template(template: Any, f: Path) -> str | None:
    """A chat template as tokenizer_config.json / chat_template.json hold it: a string, or
    named templates [{"name", "template"}] ("default" used)."""
    if isinstance(template, list):  # named templates: use "default"
        if not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and "template" in t
            for t in template
        ):
            raise ConfigError(
                f'{f}: chat_template is a list; each entry must be {{"name": ..., "template": ...}}'
            )
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{f}: chat_template={template!r} must be a string")
    return template


def _eos_from_generation_config(path: Path, tok: Tokenizer) -> str | None:
    gc = path / "generation_config.json"
    if not gc.is_file():
        return None
    eos = read_json_object(gc).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    size = tok.get_vocab_size(with_added_tokens=True)
    if eos is not None and (
        isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < size
    ):
        raise ConfigError(f"{gc}: eos_token_id={eos!r} must be a token id in [0, {size})")
    return None if eos is None else tok.id_to_token(eos)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _environment(template: str, f: Path):
    """`template` parsed in the sandbox `_render` uses: a syntax error a ConfigError naming f."""
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - `_render` says what to install
        return
    try:
        ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        ).parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{f}: chat template does not parse: {e} (line {e.lineno})") from None


def _render(template: str, source: str, **variables: Any) -> str:
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template).render(**variables)
    except jinja2.TemplateError as e:  # raise_exception(...) in the template, a syntax error
        raise ConfigError(f"{source}: chat template failed: {_first_line(e)}") from None
