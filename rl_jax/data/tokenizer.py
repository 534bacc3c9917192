"""A fixed character-level tokenizer for the built-in tasks and the tiny CPU models.

Implements the tokenizer protocol shared with the model package's HF tokenizer:
`encode(text) -> list[int]`, `decode(ids) -> str`, `pad_id`, `bos_id`,
`eos_id`, `vocab_size`. One alphabet covers every built-in task (arithmetic,
countdown, `<answer>` tags, a `;` interruption marker, short English prompts, the
one-operation functions of the generated code task),
so one tiny model can be trained on any of them.

Ids: pad 0, bos 1, eos 2, unk 3, then the characters of `ALPHABET` from 4;
`vocab_size` = 64 (the tiny preset's).
"""

from __future__ import annotations

from collections.abc import Iterable

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# '%' and "'" (appended: earlier ids stay) let the tiny model write the code task's
# remainders and string literals.
ALPHABET = "0123456789+-*/=^(){}\\ \n.,;:?<>|_abcdefghijklmnopqrstuvwxyz%'"
_SPECIALS = 4


class CharTokenizer:
    """Character tokenizer over `ALPHABET`; ASCII capitals are lowercased, anything else is unk."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    unk_id = UNK_ID
    chat_template = None  # no chat template: prompts are used as templated by the data config

    def __init__(self):
        self._to_id = {c: i + _SPECIALS for i, c in enumerate(ALPHABET)}
        self._to_char = dict(enumerate(ALPHABET, start=_SPECIALS))

    @property
    def vocab_size(self) -> int:
        return _SPECIALS + len(ALPHABET)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self._to_id.get(c, self._to_id.get(c.lower(), UNK_ID)) for c in text]
        return ([BOS_ID] if add_bos else []) + ids + ([EOS_ID] if add_eos else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; pad/bos/eos are dropped unless skip_special=False. Ids outside the
        vocabulary (a model with a padded vocab may sample them) decode to U+FFFD, which
        no verifier accepts as part of an answer."""
        names = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>", UNK_ID: "\ufffd"}
        out = []
        for i in ids:
            i = int(i)
            if i in self._to_char:
                out.append(self._to_char[i])
            elif i in names and (i == UNK_ID or not skip_special):
                out.append(names[i])
            elif i not in names:
                out.append("\ufffd")
        return "".join(out)

    def save(self, out_dir) -> None:
        """Write an HF fast tokenizer (tokenizer.json, tokenizer_config.json) that gives
        the same ids, so an exported model samples and trains with its own tokenizer
        under transformers or `rl-jax sample --model DIR`.

        Its vocabulary is keyed by the byte-level spelling of each character (GPT-2's
        byte-to-unicode map: ' ' is 'Ġ'), behind a byte-level pre-tokenizer. Read as
        written (tokenizers, `PreTrainedTokenizerFast`, transformers 4's AutoTokenizer)
        it gives exactly `encode`'s ids. transformers 5's AutoTokenizer rebuilds every
        `qwen2` model's tokenizer as Qwen2Tokenizer's byte-level BPE from this
        vocabulary, whatever the file says: that gives the same ids for the alphabet's
        own characters, but drops capitals and characters outside the alphabet instead of
        lowercasing them or reading them as unk."""
        import json
        from pathlib import Path

        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        specials = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0..3, as above
        vocab = {t: i for i, t in enumerate(specials)}
        for c, i in self._to_id.items():
            vocab[byte_level.pre_tokenize_str(c)[0][0]] = i
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.normalizer = normalizers.Lowercase()  # capitals read as lowercase, as encode does
        # One pre-token per character (so an unknown one is one unk, as in encode), then
        # its bytes in the vocabulary's spelling.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), byte_level]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(specials)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "pad_token": "<pad>",
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "unk_token": "<unk>",
            "model_max_length": 2048,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"
