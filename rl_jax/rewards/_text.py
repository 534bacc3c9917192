"""Turning untrusted model output into a bounded, well-formed str before any parsing."""

from __future__ import annotations

from typing import Literal


def bounded_text(text: object, *, limit: int, keep: Literal["head", "tail"]) -> str:
    """At most `limit` characters of `text` as valid Unicode, never raising.

    Completions are hostile input: they may be bytes with invalid UTF-8, str with
    lone surrogates (from `surrogateescape` decoding), megabytes long, or not text
    at all. Verifiers look only at the head (answers written first: arith,
    countdown) or the tail (final answers: numeric, math) of a completion, so the
    rest is cut before any regex or parser sees it.
    """
    if isinstance(text, bytes | bytearray | memoryview):
        raw = bytes(text)
        # 4 bytes per character at most in UTF-8: cut bytes first so a 1 GB blob costs nothing.
        raw = raw[: 4 * limit] if keep == "head" else raw[-4 * limit :]
        text = raw.decode("utf-8", "replace")
    elif not isinstance(text, str):
        return ""
    text = text[:limit] if keep == "head" else text[-limit:]
    # Lone surrogates cannot be encoded; replace them so later encodes/pickles never fail.
    return text.encode("utf-8", "replace").decode("utf-8")
