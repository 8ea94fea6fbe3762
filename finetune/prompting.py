"""Prompt text or chat messages -> the token ids a model continues from.

One rule for `finetune generate` and `finetune serve`, so that both feed a model the same tokens: text
is encoded as the tokenizer encodes it (with its BOS, as training documents start); messages are
rendered by the tokenizer's chat template with the generation prompt appended.

Example:
    prompt_ids(tokenizer, "def add(a, b):")                          # [bos, ...]
    chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])  # [bos, <|user|>, ..., <|assistant|>, ...]
"""

from __future__ import annotations

from typing import Any

from finetune.errors import ModelError


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text`, special tokens (BOS) added as the tokenizer adds them."""
    return list(tokenizer(text)["input_ids"])


def require_tokens(ids: list[int]) -> list[int]:
    """`ids`, if there is at least one: a model cannot continue nothing (an empty prompt with a tokenizer that
    adds no BOS, as Qwen's, gives no tokens, and the forward failed on an empty tensor).

    Raises:
        ModelError: no tokens.
    """
    if not ids:
        raise ModelError("the prompt is empty and this tokenizer adds no BOS token to it; give some prompt text")
    return ids


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The token ids of `messages` rendered by the tokenizer's chat template, ending with the generation prompt.

    Raises:
        ModelError: the tokenizer has no chat template, or its template refuses these messages.
    """
    from jinja2 import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelError("the base's tokenizer has no chat template; send plain text (a completion) instead")
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except TemplateError as exc:
        raise ModelError(f"the chat template cannot render these messages ({exc})") from None
    return list(rendered["input_ids"])
