"""Record formats: one raw record → one document of token ids and labels (-100 where no loss).

Labels are aligned with `input_ids` (the shift happens in `finetune.scoring`). Every document's first
label is -100: nothing precedes it, and in a packed row it must not be predicted from the previous
document. EOS always ends a document as a trained label, so the tuned model learns to stop.

- `text`: BOS (when the tokenizer has one) + text + EOS; loss on every token but the first.
- `instruction`: BOS + rendered prompt, then response + EOS. The two parts are tokenized separately, as
  they are at inference (the prompt is encoded, the model writes the rest), so no BPE merge crosses the
  boundary. With `completion_only_loss` the loss is on response + EOS only.
- `chat`: the messages rendered by the chat template (`data.chat_template`, else the tokenizer's), which
  owns BOS and the turn delimiters. With `completion_only_loss` the loss is on the assistant turns only:
  from `return_assistant_tokens_mask` when the template marks them with `{% generation %}`, otherwise by
  rendering the conversation with that turn's content replaced by a sentinel (see `_render_by_sentinel`):
  the turn's content through the end-of-turn token after it, whitespace between them included. Records
  come in OpenAI `messages` (role/content) or ShareGPT `conversations` (from/value) shape; a template
  that refuses a system message (Gemma 2) gets it folded into the first user turn.

A record with nothing to train on (empty text, a chat without assistant turns under completion-only
loss) encodes to None and is dropped by the caller, who counts it.

Example:
    docs = encode_records([{"text": "hello"}], config, tokenizer, locate=lambda i: f"record {i + 1}")
    docs[0].input_ids  # [bos, ..., eos]
    docs[0].labels     # [-100, ..., eos]
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

from transformers import PreTrainedTokenizerBase

from finetune.data.labels import IGNORE_INDEX
from finetune.errors import DataError
from finetune.recipe import DataConfig

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PLACEHOLDER = re.compile(r"\{(prompt|input)\}")
_SENTINEL = "\u2063ft-assistant-turn\u2063"  # invisible separator: never in real data, survives `| trim`


@dataclass(frozen=True)
class Document:
    """One record as tokens. `labels[i]` is the target at position i, or -100 for no loss."""

    input_ids: list[int]
    labels: list[int]


Locate = Callable[[int], str]
"""Names record i (0-based, within the batch's source) for an error message, e.g. `a.jsonl line 3 (record 3)`."""


def encode_records(
    records: list[dict[str, Any]], config: DataConfig, tokenizer: PreTrainedTokenizerBase, locate: Locate
) -> list[Document | None]:
    """Encode a batch of records of one source; None where a record has nothing to train on.

    Args:
        records: raw records; `locate(i)` names records[i] in errors.
        config: the format and its field names, templates and loss choice.
        tokenizer: supplies ids, BOS/EOS and the chat template.

    Raises:
        DataError: a record lacks a field its format needs, or a field has the wrong type.
    """
    if tokenizer.eos_token_id is None:
        raise DataError(
            "the tokenizer has no EOS token, so documents cannot end with a trained stop token; "
            "use a tokenizer that defines eos_token"
        )
    encoder = {"text": _encode_text, "instruction": _encode_instruction, "chat": _encode_chat}[config.format]
    return encoder(records, config, tokenizer, locate)


def _bos(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


@overload
def _string_field(record: dict[str, Any], name: str, config_key: str, where: str) -> str: ...
@overload
def _string_field(
    record: dict[str, Any], name: str, config_key: str, where: str, required: Literal[False]
) -> str | None: ...
def _string_field(record: dict[str, Any], name: str, config_key: str, where: str, required: bool = True) -> str | None:
    """The string value of `record[name]`; a missing or null optional field is None."""
    value = record.get(name)
    if value is None:
        if not required:
            return None
        if name not in record:
            have = ", ".join(repr(key) for key in record) or "none"
            raise DataError(
                f"{where}: no field {name!r} (fields it has: {have}); set data.{config_key} "
                f"to the field that holds it, or fix the record"
            )
        raise DataError(f"{where}: field {name!r} is null; give it a string or remove the record")
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {name!r} must be a string, got {type(value).__name__} "
            f"{_preview(value)}; fix the record or set data.{config_key}"
        )
    return value


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _tokenize(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (the formats add BOS/EOS themselves)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _encode_text(records, config, tokenizer, locate) -> list[Document | None]:
    texts = [_string_field(r, config.text_field, "text_field", locate(i)) for i, r in enumerate(records)]
    keep = [i for i, text in enumerate(texts) if text.strip()]
    token_ids = _tokenize(tokenizer, [texts[i] for i in keep])
    documents: list[Document | None] = [None] * len(records)
    bos, eos = _bos(tokenizer), [tokenizer.eos_token_id]
    for i, ids in zip(keep, token_ids):
        input_ids = bos + ids + eos
        documents[i] = Document(input_ids, [IGNORE_INDEX] + input_ids[1:])
    return documents


def render_prompt(template: str, prompt: str, input_text: str | None = None) -> str:
    """Fill `{prompt}` and `{input}` in one pass: braces elsewhere stay, and values are never re-expanded."""
    values = {"prompt": prompt, "input": input_text or ""}
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], template)


def _encode_instruction(records, config, tokenizer, locate) -> list[Document | None]:
    prompts, responses = [], []
    for i, record in enumerate(records):
        where = locate(i)
        prompt = _string_field(record, config.prompt_field, "prompt_field", where)
        response = _string_field(record, config.response_field, "response_field", where)
        extra = None
        if config.input_field:
            extra = _string_field(record, config.input_field, "input_field", where, required=False)
        if extra and extra.strip():
            prompts.append(render_prompt(config.prompt_with_input_template, prompt, extra))
        else:
            prompts.append(render_prompt(config.prompt_template, prompt))
        responses.append(response)
    documents: list[Document | None] = []
    bos, eos = _bos(tokenizer), [tokenizer.eos_token_id]
    for prompt_ids, response_ids in zip(_tokenize(tokenizer, prompts), _tokenize(tokenizer, responses)):
        prompt_ids = bos + prompt_ids
        response_ids = response_ids + eos
        input_ids = prompt_ids + response_ids
        if config.completion_only_loss:
            labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
        else:
            labels = list(input_ids)
        labels[0] = IGNORE_INDEX
        documents.append(Document(input_ids, labels))
    return documents


def _encode_chat(records, config, tokenizer, locate) -> list[Document | None]:
    template = chat_template_of(config, tokenizer)
    documents: list[Document | None] = []
    for i, record in enumerate(records):
        where = locate(i)
        messages = _messages_field(record, config.messages_field, where)
        if not config.completion_only_loss:
            input_ids = list(_apply_template(tokenizer, messages, template, where, tokenize=True, return_dict=False))
            labels = list(input_ids)
        else:
            input_ids, trained = render_chat(messages, template, tokenizer, where)
            labels = [token if keep else IGNORE_INDEX for token, keep in zip(input_ids, trained)]
        if labels:
            labels[0] = IGNORE_INDEX
        trainable = any(label != IGNORE_INDEX for label in labels)
        documents.append(Document(input_ids, labels) if trainable else None)
    return documents


def chat_template_of(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja template chat records are rendered with: `data.chat_template`, else the tokenizer's."""
    if config.chat_template is not None:
        return config.chat_template
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        raise DataError(
            "data.format is chat but the tokenizer has no chat template; set data.chat_template "
            "to a Jinja template (with {% generation %} around assistant turns)"
        ) from None


_SHAREGPT_FIELD = "conversations"
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}


def _from_sharegpt(record: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """ShareGPT `conversations` (`from`/`value`, with human/gpt/system) as OpenAI `messages` (`role`/`content`)."""
    turns = record[_SHAREGPT_FIELD]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DataError(f"{where}: field 'conversations' must be a list of {{from, value}} objects; fix the record")
    messages = []
    for index, turn in enumerate(turns):
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in _SHAREGPT_ROLES or not isinstance(value, str):
            raise DataError(
                f"{where}: conversations[{index}] needs 'from' (one of {', '.join(_SHAREGPT_ROLES)}) "
                f"and a string 'value', got from={speaker!r}; fix the record"
            )
        messages.append({"role": _SHAREGPT_ROLES[speaker], "content": value})
    return messages


def _messages_field(
    record: dict[str, Any], name: str, where: str, hint: str = "; fix the record or set data.messages_field"
) -> list[dict[str, Any]]:
    """The record's messages: OpenAI shape in `name` (`role`/`content`), else ShareGPT `conversations`."""
    messages = record.get(name)
    if messages is None and _SHAREGPT_FIELD in record:
        messages = _from_sharegpt(record, where)
    if messages is None:
        _string_field(record, name, "messages_field", where)  # raises the missing/null error
    if not isinstance(messages, list) or not messages:
        kind = "an empty list" if isinstance(messages, list) else f"{type(messages).__name__} {_preview(messages)}"
        raise DataError(
            f"{where}: field {name!r} must be a non-empty list of {{role, content}} messages, got {kind}{hint}"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: {name}[{index}] must be an object with 'role' and 'content', got "
                f"{type(message).__name__} {_preview(message)}; fix the record"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else type(message[key]).__name__
                raise DataError(
                    f"{where}: {name}[{index}].{key} must be a string, got {got}; "
                    f"each message needs a string 'role' and 'content'"
                )
    return messages


def _fold_system_prompt(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A leading system message prepended to the first user turn (as Gemma 3's own template does)."""
    system, first_user, *rest = messages
    return [{**first_user, "content": f"{system['content']}\n\n{first_user['content']}"}, *rest]


def _apply_template(tokenizer, messages, template: str, where: str, **kwargs):
    """Render `messages`; a template that refuses a leading system message (Gemma 2, Mistral) gets it folded
    into the first user turn, as Gemma 3's template does itself."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, **kwargs)
    except TemplateError as exc:
        folds = len(messages) > 1 and messages[0]["role"] == "system" and messages[1]["role"] == "user"
        if folds:  # templates without a system role (Gemma 2, Mistral's) refuse it: fold it into the first turn
            return _apply_template(tokenizer, _fold_system_prompt(messages), template, where, **kwargs)
        raise DataError(
            f"{where}: the chat template cannot render this conversation ({exc}); fix the "
            f"messages or data.chat_template"
        ) from None


def render_chat(messages, template: str, tokenizer, where: str) -> tuple[list[int], list[bool]]:
    """Token ids of a conversation rendered by `template`, and for each whether completion-only loss trains it
    (an assistant turn's content and its end-of-turn token): from the template's `{% generation %}` marks when
    it has them, else located by sentinel rendering."""
    render = _render_with_mask if _GENERATION_MARKER.search(template) else _render_by_sentinel
    return render(messages, template, tokenizer, where)


def render_chat_prompt(messages, template: str, tokenizer, where: str) -> list[int]:
    """Token ids of `messages` rendered as a prompt: with the template's generation prompt (the assistant's
    turn header) at the end, as at inference."""
    rendered = _apply_template(
        tokenizer, messages, template, where, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    return list(rendered)


def _render_with_mask(messages, template, tokenizer, where) -> tuple[list[int], list[bool]]:
    out = _apply_template(
        tokenizer, messages, template, where, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), [bool(flag) for flag in out["assistant_masks"]]


def _render_by_sentinel(messages, template, tokenizer, where) -> tuple[list[int], list[bool]]:
    """Assistant-token flags for a template without `{% generation %}`: find each turn's characters.

    Each assistant turn is located by rendering the whole conversation once more with that turn's content
    replaced by a sentinel: the text before the sentinel and the text after it are the template's own, so
    the turn's content spans the rest of the real rendering, however the template trims or wraps it, and
    whatever it appends after the last turn (Phi-3's EOS) or injects before the first (a default system
    prompt, Llama 3.1's dates). The turn's label span is its content through the end-of-turn token that
    follows it (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, `<|end|>`, `</s>`, ...; see `_turn_end`).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            "chat records rendered by a template without {% generation %} markers need a fast "
            "tokenizer (for character offsets); add the markers to data.chat_template"
        )

    def render(conversation: list[dict[str, Any]]) -> str:
        return _apply_template(tokenizer, conversation, template, where, tokenize=False)

    full = render(messages)
    end_tokens = sorted(set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab()), key=len, reverse=True)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        marked = render([*messages[:index], {**message, "content": _SENTINEL}, *messages[index + 1 :]])
        start = marked.find(_SENTINEL)
        suffix = marked[start + len(_SENTINEL) :] if start >= 0 else ""
        if start < 0 or marked.count(_SENTINEL) != 1 or full[:start] != marked[:start] or not full.endswith(suffix):
            raise DataError(
                f"{where}: the chat template renders text that depends on the assistant's words, so "
                f"assistant turns cannot be located; add {{% generation %}}...{{% endgeneration %}} "
                f"around assistant content in data.chat_template, or set data.completion_only_loss=false"
            )
        spans.append((start, _turn_end(full, len(full) - len(suffix), end_tokens)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    flags = [any(first < end and last > start for start, end in spans) for first, last in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), flags


def _turn_end(full: str, content_end: int, end_tokens: list[str]) -> int:
    """Where the label span of an assistant turn whose content ends at `content_end` in `full` stops.

    After the special token (longest first among `end_tokens`) that follows the content, together with
    any whitespace the template puts between them (a space or a newline before the end-of-turn token):
    the model has to write all of it to stop. Without such a token, at the content's end.
    """
    token_start = content_end
    while token_start < len(full) and full[token_start].isspace():
        token_start += 1
    token = next((token for token in end_tokens if token and full.startswith(token, token_start)), None)
    return content_end if token is None else token_start + len(token)
