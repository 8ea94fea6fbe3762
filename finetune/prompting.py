"""Prompt text or chat messages -> the token ids a model continues from.

One rule for `finetune generate` and `finetune serve`, so that both feed a model the same tokens: text
is encoded as training documents start (BOS where the tokenizer has one, then the text); messages are
rendered by the tokenizer's chat template with the generation prompt appended.

Example:
    prompt_ids(tokenizer, "def add(a, b):")                          # [bos, ...]
    chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])  # [bos, <|user|>, ..., <|assistant|>, ...]
"""

from __future__ import annotations

from typing import Any

from finetune.errors import ModelError


def with_bos(bos_id: int | None, ids: list[int]) -> list[int]:
    """`ids` led by BOS (where the tokenizer has one), unless their own text already began with it: a doubled
    BOS is input the model never saw in pretraining."""
    return list(ids) if bos_id is None or ids[:1] == [bos_id] else [bos_id, *ids]


def with_eos(ids: list[int], eos_id: int) -> list[int]:
    """`ids` closed by EOS, unless their own text already ended with it (a doubled EOS trains stopping twice)."""
    return list(ids) if ids[-1:] == [eos_id] else [*ids, eos_id]


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text` as a training document of `text` or `instruction` records starts: BOS where the
    tokenizer has one, once, then the text. Not the tokenizer's own choice: GPT-2-style tokenizers (GPT-2,
    Pythia, Phi-2) name a BOS but do not add it, and an adapter trained on documents that start with it would
    be prompted without it."""
    return with_bos(tokenizer.bos_token_id, list(tokenizer(text, add_special_tokens=False)["input_ids"]))


def require_tokens(ids: list[int]) -> list[int]:
    """`ids`, if there is at least one: a model cannot continue nothing (an empty prompt with a tokenizer that
    has no BOS, as Qwen's, gives no tokens, and the forward failed on an empty tensor).

    Raises:
        ModelError: no tokens.
    """
    if not ids:
        raise ModelError("the prompt is empty and this tokenizer has no BOS token to start it; give some prompt text")
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
