"""How a question becomes the text a model is prompted with.

    question -> data.prompt_template -> + data.answer_instruction (after a blank line)
             -> the model's chat template (system message data.system_prompt, the text as
                the user's message, the generation prompt) when its tokenizer ships one

The chat template is rendered by the tokenizer (`HFTokenizer.apply_chat_template`, jinja
as transformers renders it); the prompt's token ids are then `tokenizer.encode(text)`
without special tokens, as transformers' `apply_chat_template(..., tokenize=True)` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl_jax.config.data import DataConfig

# data.answer_instruction=auto: how each verifier reads an answer, said to the model.
ANSWER_INSTRUCTIONS = {
    "numeric": "Solve the problem step by step, then give the final answer as a number on "
    "the last line, after '####' (for example: #### 42).",
    "math": "Solve the problem step by step, then put the final answer in \\boxed{} "
    "(for example: \\boxed{42}).",
    "code": "Write your solution in Python, in one ```python code block.",
}
# Sources of natural-language questions written for people, which do not say how to answer
# (generated tasks have a fixed format of their own).
_NEEDS_INSTRUCTION = ("file", "hf", "tfds")


def answer_instruction(cfg: DataConfig, verifier: str) -> str:
    """The instruction appended to each question: data.answer_instruction, or for 'auto'
    the verifier's own (numeric, math) on file / hf / tfds data with the plain
    '{question}' template, else none (a template of one's own says how to answer)."""
    if cfg.answer_instruction != "auto":
        return cfg.answer_instruction
    if cfg.source not in _NEEDS_INSTRUCTION or cfg.prompt_template != "{question}":
        return ""
    return ANSWER_INSTRUCTIONS.get(verifier, "")


def uses_chat_template(cfg: DataConfig, tokenizer: Any) -> bool:
    return bool(cfg.chat_template and getattr(tokenizer, "chat_template", None))


def messages(user_text: str, *, system_prompt: str = "") -> list[dict[str, str]]:
    sys_msg = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*sys_msg, {"role": "user", "content": user_text}]


def prompt_renderer(
    cfg: DataConfig, tokenizer: Any = None, *, verifier: str = ""
) -> Callable[[str], str]:
    """`fn(templated question) -> prompt text` for `cfg` and the model's tokenizer (None:
    plain text). Without a chat template, a system prompt is put before the text."""
    instruction = answer_instruction(cfg, verifier)
    chat = uses_chat_template(cfg, tokenizer)
    system = cfg.system_prompt

    def render(text: str) -> str:
        if instruction:
            text = f"{text}\n\n{instruction}"
        if chat:
            return tokenizer.apply_chat_template(
                messages(text, system_prompt=system), add_generation_prompt=True
            )
        return f"{system}\n\n{text}" if system else text

    return render
