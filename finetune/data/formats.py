"""Record formats: one raw record → one document of token ids and labels (-100 where no loss).

Labels are aligned with `input_ids` (the shift happens in `finetune.scoring`). Every document's first
label is -100: nothing precedes it, and in a packed row it must not be predicted from the previous
document. EOS always ends a document as a trained label, so the tuned model learns to stop.

- `text`: BOS (when the tokenizer has one) + text + EOS; loss on every token but the first.
- `instruction`: BOS + rendered prompt, then response + EOS. The two parts are tokenized separately, as
  they are at inference (the prompt is encoded, the model writes the rest), so no BPE merge crosses the
  boundary. With `completion_only_loss` the loss is on response + EOS only.
- `chat`: the messages (with tools, tool calls, tool results and reasoning: `finetune.data.chat`)
  rendered by the chat template (`data.chat_template`, else the tokenizer's), which owns BOS and the turn
  delimiters. With `completion_only_loss` the loss is on the assistant turns only, each from after its
  generation prompt through its closing token (`finetune.data.chat_turns`). `data.reasoning: every_turn`
  makes one document per assistant turn (`Document.more`).

In `text` and `instruction`, BOS and EOS are each added once: text that already starts with the BOS token
or ends with the EOS token (a chat rendered to text with its `<|begin_of_text|>`, a response written with a
closing `</s>`, a prompt template beginning `<s>`) gets no second one, as trl adds EOS only where it is missing; a doubled
BOS is input the model never saw in pretraining, and a doubled EOS trains stopping twice.

A record with nothing to train on (empty text, an empty response, a chat without assistant turns under
completion-only loss) encodes to None and is dropped by the caller, who counts it.

Example:
    docs = encode_records([{"text": "hello"}], config, tokenizer, locate=lambda i: f"record {i + 1}")
    docs[0].input_ids  # [bos, ..., eos]
    docs[0].labels     # [-100, ..., eos]
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from finetune.data.chat import ChatRecord, normalize_messages, normalize_record, normalize_tools
from finetune.data.chat_turns import (
    apply_template,
    check_turn_closer,
    render_chat,
    render_chat_prompt,
    render_every_turn,
    renders_reasoning,
)
from finetune.data.labels import IGNORE_INDEX
from finetune.errors import DataError
from finetune.prompting import with_bos, with_eos
from finetune.recipe import DataConfig

if TYPE_CHECKING:  # the quickstart pairs' generator renders prompts without loading transformers (3 s)
    from transformers import PreTrainedTokenizerBase

_PLACEHOLDER = re.compile(r"\{(prompt|input)\}")


@dataclass(frozen=True)
class Document:
    """One record as tokens. `labels[i]` is the target at position i, or -100 for no loss."""

    input_ids: list[int]
    labels: list[int]
    more: tuple[Document, ...] = ()
    """Further documents of the same record (`data.reasoning: every_turn` makes one per assistant turn)."""
    reasoning_dropped: bool = False
    """The record has assistant reasoning that the chat template renders in no turn (the DeepSeek-R1 distills'
    drops it from every turn), so none of it is trained: counted for a log line, not refused."""

    def with_more(self) -> list[Document]:
        """This document and the further ones of its record, each on its own."""
        return [Document(self.input_ids, self.labels), *self.more]


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
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for i, ids in zip(keep, token_ids):
        input_ids = with_eos(with_bos(bos, ids), eos)
        if len(input_ids) > 1:  # a text of nothing but BOS/EOS has no token to train
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
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    tokenized = zip(_tokenize(tokenizer, prompts), _tokenize(tokenizer, responses), responses)
    for prompt_ids, response_ids, response in tokenized:
        if not response.strip():  # an empty answer would teach stopping at once: dropped (and counted) like empty text
            documents.append(None)
            continue
        prompt_ids = with_bos(bos, prompt_ids)
        response_ids = with_eos(response_ids, eos)
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
        chat = normalize_record(record, config.messages_field, where, config.tools_field)
        if not config.completion_only_loss:
            ids = apply_template(tokenizer, chat, template, where, config.reasoning, tokenize=True, return_dict=False)
            examples = [(list(ids), [True] * len(ids))]
        elif config.reasoning == "every_turn":
            examples = render_every_turn(chat, template, tokenizer, where)
        else:
            examples = [render_chat(chat, template, tokenizer, where, config.reasoning)]
        turns = [_document(input_ids, trained) for input_ids, trained in examples]
        kept = [document for document in turns if document is not None]
        dropped = config.reasoning != "none" and _has_reasoning(chat) and not renders_reasoning(tokenizer, template)
        documents.append(Document(kept[0].input_ids, kept[0].labels, tuple(kept[1:]), dropped) if kept else None)
    return documents


def _has_reasoning(chat: ChatRecord) -> bool:
    return any(message["role"] == "assistant" and message.get("reasoning") for message in chat.messages)


def _document(input_ids: list[int], trained: list[bool]) -> Document | None:
    """A document from token ids and their trained flags; None when nothing is trained (the first token
    never is: nothing precedes it)."""
    labels = [token if keep else IGNORE_INDEX for token, keep in zip(input_ids, trained)]
    if labels:
        labels[0] = IGNORE_INDEX
    return Document(input_ids, labels) if any(label != IGNORE_INDEX for label in labels) else None


def chat_template_of(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja template chat records are rendered with: `data.chat_template`, else the tokenizer's; refused
    where its assistant turns end with no token the tuned model can stop on (`check_turn_closer`)."""
    try:
        template = config.chat_template if config.chat_template is not None else tokenizer.get_chat_template()
    except ValueError:
        raise DataError(
            "data.format is chat but the tokenizer has no chat template; set data.chat_template "
            "to a Jinja template (with {% generation %} around assistant turns)"
        ) from None
    check_turn_closer(tokenizer, template)
    return template


def encode_chat_prompt(
    prompt: Any, config: DataConfig, tokenizer: PreTrainedTokenizerBase, where: str, tools: Any = None
) -> list[int]:
    """A prompt given as chat messages (any shape `chat` records take: tool calls, tool results, reasoning)
    as token ids, rendered by the chat template with its generation prompt at the end, as at inference:
    what a sampler continues (GRPO's `data.format: prompt`). `tools` is the record's function schemas.

    Raises:
        DataError: a malformed message or tool record, naming `where`.
    """
    schemas = normalize_tools(tools, where, config.tools_field)
    chat = ChatRecord(normalize_messages(prompt, where, schemas, "prompt"), schemas)
    return render_chat_prompt(chat, chat_template_of(config, tokenizer), tokenizer, where, config.reasoning)
