"""Prompt text or chat messages -> the token ids a model continues from, and the tokens that end its reply.

One rule for `finetune generate` and `finetune serve`, so that both feed a model the same tokens: text
is encoded as training documents start (BOS where the tokenizer has one, then the text); messages are
rendered by the tokenizer's chat template with the generation prompt appended. Both stop at the same
tokens: the tokenizer's EOS and those of the model's generation config (a chat model's end of turn).

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


def stop_token_ids(eos_id: int | None, configured: int | list[int] | None) -> frozenset[int]:
    """The tokens that end a reply: the tokenizer's EOS and the generation config's `eos_token_id` (one id or a
    list). Gemma's instruction models name `<eos>` as the tokenizer's EOS and end their turns with
    `<end_of_turn>`, listed only in the generation config: `finetune generate` stopped at the first alone, and
    printed the reply's end of turn followed by a made-up next turn, where `finetune serve` stopped."""
    ids = {eos_id, *(configured if isinstance(configured, list) else [configured])}
    return frozenset(i for i in ids if isinstance(i, int))


def model_stop_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """`stop_token_ids` of a loaded model and its tokenizer."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return stop_token_ids(tokenizer.eos_token_id, configured)


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The token ids of `messages` rendered by the tokenizer's chat template, ending with the generation prompt.

    Raises:
        ModelError: the tokenizer has no chat template, or its template refuses these messages.
    """
    from jinja2 import TemplateError

    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelError(
            "the tokenizer (the adapter's where it carries one, else the base's) has no chat template; send plain "
            "text (a completion) instead, or use an adapter trained with data.chat_template"
        )
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except TemplateError as exc:
        raise ModelError(f"the chat template cannot render these messages ({exc})") from None
    return list(rendered["input_ids"])
