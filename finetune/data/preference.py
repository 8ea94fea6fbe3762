"""Preference records → rows: `{prompt, chosen, rejected}` pairs and `{prompt, completion, label}` examples.

The two shapes trl documents are accepted, per record:
- standard: `prompt`, `chosen`, `rejected` (or `completion`) are strings. The prompt is used as written,
  after BOS (when the tokenizer has one); each completion is tokenized on its own and ends with EOS, as
  the `instruction` format does (the model is given the prompt's tokens and writes the rest, so no BPE
  merge crosses the boundary). trl tokenizes prompt + completion together and cuts where they diverge;
  the two agree whenever the prompt ends on a token boundary.
- conversational: `prompt` is a list of chat messages and each completion a list of messages (usually one
  assistant turn) or a string (taken as one assistant turn). Prompt + completion is rendered with the chat
  template exactly as `chat` records are (`finetune.data.chat_turns.render_chat`; tool calls, tool results,
  reasoning and a `tools` field read as `finetune.data.chat` reads them), and trained where that
  marks assistant turns (content and end-of-turn token), except in the prompt: everything up to where
  the prompt rendered with its generation prompt stops matching is context, untrained.

A pair becomes one row holding both sequences in full (prompt included): `chosen_input_ids`,
`chosen_labels`, `rejected_input_ids`, `rejected_labels` (-100 where no loss), so the sampler draws
pairs and a micro-batch is `micro_batch_size` pairs. An unpaired example becomes `input_ids`, `labels`,
`prompt_length` (its leading untrained tokens, which KTO's KL term pairs with other completions) and
`desirable`.

Too long for `data.max_seq_len`: `truncate` cuts each sequence's end (a record whose prompt leaves no room
for one completion token cannot be trained and is counted; the pipeline refuses the data naming how many),
`truncate_prompt` drops tokens from the prompt's start (after its first) until the longer completion fits,
and `error` refuses the record.

Example:
    rows = encode_preference_records([{"prompt": "2+2=", "chosen": "4", "rejected": "5"}], config, tokenizer,
                                     locate=lambda i: f"record {i + 1}")
    rows[0].row["chosen_input_ids"]   # [bos, ..., eos]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import datasets

from finetune.data.chat import ChatRecord, normalize_messages, normalize_tools
from finetune.data.chat_turns import render_chat
from finetune.data.formats import _preview, _tokenize, chat_template_of
from finetune.data.labels import IGNORE_INDEX
from finetune.data.sources import iter_records, load_source
from finetune.errors import DataError
from finetune.prompting import with_bos, with_eos
from finetune.recipe import DataConfig

_IDS = datasets.Sequence(datasets.Value("int32"))
PAIR_FEATURES = datasets.Features(
    {"chosen_input_ids": _IDS, "chosen_labels": _IDS, "rejected_input_ids": _IDS, "rejected_labels": _IDS}
)
"""Columns of a `preference` row: both sequences of a pair, whole."""
UNPAIRED_FEATURES = datasets.Features(
    {
        "input_ids": _IDS,
        "labels": _IDS,
        "prompt_length": datasets.Value("int32"),
        "desirable": datasets.Value("bool"),
    }
)
"""Columns of an `unpaired_preference` row."""
ROW_FEATURES_BY_FORMAT = {"preference": PAIR_FEATURES, "unpaired_preference": UNPAIRED_FEATURES}


@dataclass(frozen=True)
class Sequence:
    """A prompt and completion as one sequence: `prompt_length` leading tokens are context (labels -100)."""

    input_ids: list[int]
    labels: list[int]
    prompt_length: int


@dataclass(frozen=True)
class EncodedRecord:
    """One record's row (None: nothing left to train) and what the pipeline counts about it."""

    row: dict[str, Any] | None
    tokens_in: int
    tokens_kept: int
    too_long: bool
    no_room: bool
    """The prompt leaves no room for a completion token within max_seq_len (under `truncate`)."""


Locate = Any  # Callable[[int], str], as in finetune.data.formats


def encode_preference_records(
    records: list[dict[str, Any]], config: DataConfig, tokenizer: Any, locate: Locate
) -> list[EncodedRecord]:
    """Encode a batch of records of one source into rows of `ROW_FEATURES_BY_FORMAT[config.format]`.

    Raises:
        DataError: a missing or mistyped field, chosen equal to rejected (as written, or once cut to
            max_seq_len), a label that is not a boolean,
            a completion with no assistant turn, or (overlength `error`) a record longer than max_seq_len.
    """
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token, so completions cannot end with one; set eos_token")
    paired = config.format == "preference"
    encoded = []
    for index, record in enumerate(records):
        where = locate(index)
        names = ("chosen", "rejected") if paired else ("completion",)
        values = _fields(record, ("prompt", *names), where)
        tools = record.get(config.tools_field)
        sequences = [
            _sequence(values["prompt"], values[name], config, tokenizer, f"{where} {name}", tools) for name in names
        ]
        # the tokens, not the fields: a string and the one assistant message it stands for are the same completion
        if paired and sequences[0].input_ids == sequences[1].input_ids:
            raise DataError(
                f"{where}: chosen and rejected are the same {_preview(values['chosen'])}; a pair must prefer one "
                "completion over a different one: fix or remove the record"
            )
        fitted, too_long, no_room = _fit(sequences, config, where)
        if paired and too_long and not no_room and fitted[0].input_ids == fitted[1].input_ids:
            raise _same_when_cut(sequences, config, where)
        tokens_in = sum(len(s.input_ids) for s in sequences)
        kept = sum(len(s.input_ids) for s in fitted) if not no_room else 0
        row = None if no_room else _row(fitted, None if paired else _label(record, where))
        encoded.append(EncodedRecord(row, tokens_in, kept, too_long, no_room))
    return encoded


def _fields(record: dict[str, Any], names: tuple[str, ...], where: str) -> dict[str, Any]:
    missing = [name for name in names if record.get(name) is None]
    if missing and missing[0] in record:
        raise DataError(f"{where}: field {missing[0]!r} is null; a preference record needs {', '.join(names)}")
    if missing:
        have = ", ".join(repr(key) for key in record) or "none"
        raise DataError(
            f"{where}: no field {missing[0]!r} (fields it has: {have}); a preference record needs "
            f"{', '.join(names)}: fix the record"
        )
    return {name: record[name] for name in names}


def _label(record: dict[str, Any], where: str) -> bool:
    label = record.get("label")
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):  # a .csv file holds strings only
        label = label.strip().lower() == "true"
    if not isinstance(label, bool):
        got = "missing" if "label" not in record else f"{type(label).__name__} {_preview(label)}"
        raise DataError(
            f"{where}: field 'label' must be true (desirable) or false (undesirable), got {got}; fix the record"
        )
    return label


def _sequence(prompt: Any, completion: Any, config: DataConfig, tokenizer: Any, where: str, tools: Any) -> Sequence:
    """Prompt + completion as token ids and labels, in the record's shape (standard or conversational)."""
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise DataError(
                f"{where}: the prompt is a string, so the completion must be one too, got "
                f"{type(completion).__name__} {_preview(completion)}; give both as strings or both as messages"
            )
        prompt_ids = with_bos(tokenizer.bos_token_id, _tokenize(tokenizer, [prompt])[0])  # BOS and EOS once, as `text`
        completion_ids = with_eos(_tokenize(tokenizer, [completion])[0], tokenizer.eos_token_id) if completion else []
        if not completion_ids:
            raise DataError(f"{where}: the completion is empty; give it text to train on, or remove the record")
        labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids
        labels[0] = IGNORE_INDEX  # nothing precedes it: packed, it would be predicted from the sequence before
        return Sequence(prompt_ids + completion_ids, labels, len(prompt_ids))
    if not isinstance(prompt, list):
        raise DataError(
            f"{where}: the prompt must be a string or a list of {{role, content}} messages, got "
            f"{type(prompt).__name__} {_preview(prompt)}; fix the record"
        )
    return _chat_sequence(prompt, completion, config, tokenizer, where, tools)


def _chat_sequence(
    prompt: list, completion: Any, config: DataConfig, tokenizer: Any, where: str, raw_tools: Any
) -> Sequence:
    """Prompt + completion messages (the shapes `chat` records take, tools included) rendered as one
    conversation; trained where its assistant turns are, after the prompt."""
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    tools = normalize_tools(raw_tools, where, config.tools_field)
    prompt_messages = normalize_messages(prompt, where, tools, "prompt")
    completion_messages = normalize_messages(completion, where, tools, "completion")
    template = chat_template_of(config, tokenizer)
    conversation = ChatRecord([*prompt_messages, *completion_messages], tools)
    train_from = len(prompt_messages)
    input_ids, trained = render_chat(conversation, template, tokenizer, where, config.reasoning, train_from)
    prompt_length = next((position for position, keep in enumerate(trained) if keep), len(input_ids))
    labels = [
        token if keep and position >= 1 else IGNORE_INDEX
        for position, (token, keep) in enumerate(zip(input_ids, trained))
    ]
    if all(label == IGNORE_INDEX for label in labels):
        raise DataError(
            f"{where}: the completion has no assistant turn to train ({_preview(completion)}); give it "
            "an assistant message"
        )
    return Sequence(input_ids, labels, prompt_length)


def _fit(sequences: list[Sequence], config: DataConfig, where: str) -> tuple[list[Sequence], bool, bool]:
    """`data.overlength` applied to a record's sequences: (fitted, whether too long, whether no room is left).

    Both completions of a pair share one prompt, so `truncate_prompt` cuts it the same way on both sides.
    """
    limit = config.max_seq_len
    longest = max(len(s.input_ids) for s in sequences)
    if longest <= limit:
        return sequences, False, False
    if config.overlength == "error":
        raise DataError(
            f"{where}: {longest} tokens, longer than data.max_seq_len={limit}; raise data.max_seq_len, shorten the "
            "record, or set data.overlength to truncate or truncate_prompt"
        )
    if config.overlength == "truncate_prompt":
        sequences = [_cut_prompt(s, longest - limit) for s in sequences]
    fitted = [Sequence(s.input_ids[:limit], s.labels[:limit], min(s.prompt_length, limit)) for s in sequences]
    no_room = any(all(label == IGNORE_INDEX for label in s.labels) for s in fitted)
    return fitted, True, no_room


def _same_when_cut(sequences: list[Sequence], config: DataConfig, where: str) -> DataError:
    """The error for a pair whose completions differ only beyond max_seq_len: cut to it, chosen equals rejected,
    a pair with no preference in it (its loss a constant, its gradient 0) that would dilute every step it is in."""
    chosen, rejected = (s.input_ids for s in sequences)
    shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    return DataError(
        f"{where}: chosen and rejected differ only from token {shared + 1} on (prompt included), so cut to "
        f"data.max_seq_len={config.max_seq_len} ({config.overlength}) they are the same; raise data.max_seq_len, "
        "or shorten the record's prompt or the start its completions share"
    )


def _cut_prompt(sequence: Sequence, excess: int) -> Sequence:
    """Drop up to `excess` prompt tokens from the prompt's start, keeping its first (BOS or the template's
    first token) and at least one more, so the prompt still ends as it did."""
    drop = max(0, min(excess, sequence.prompt_length - 2))
    keep = [0, *range(1 + drop, len(sequence.input_ids))]
    return Sequence(
        [sequence.input_ids[i] for i in keep], [sequence.labels[i] for i in keep], sequence.prompt_length - drop
    )


def _row(sequences: list[Sequence], desirable: bool | None) -> dict[str, Any]:
    if desirable is None:
        chosen, rejected = sequences
        return {
            "chosen_input_ids": chosen.input_ids,
            "chosen_labels": chosen.labels,
            "rejected_input_ids": rejected.input_ids,
            "rejected_labels": rejected.labels,
        }
    (sequence,) = sequences
    return {
        "input_ids": sequence.input_ids,
        "labels": sequence.labels,
        "prompt_length": sequence.prompt_length,
        "desirable": desirable,
    }


def no_room_error(count: int, total: int, first: str, config: DataConfig) -> DataError:
    """The one-line error for records whose prompt fills max_seq_len under `truncate`."""
    which = f"{first}: the prompt leaves" if total == 1 else f"{count} of {total} records have a prompt that leaves"
    return DataError(
        f"{which} no room for the completion within data.max_seq_len={config.max_seq_len}"
        + ("" if total == 1 else f" (the first: {first})")
        + "; set data.overlength=truncate_prompt to cut the prompts' start instead, or raise data.max_seq_len"
    )


def preview_records(config: DataConfig, tokenizer: Any, limit: int) -> list[tuple[int, dict[str, Any]]]:
    """The first `limit` rows of the first source as training sees them, with each record's number (1-based).

    Records are encoded and fitted to max_seq_len as training does; one whose prompt leaves no room for a
    completion is refused as training refuses it (DataError).
    """
    raw = load_source(config.train[0], config.text_field)
    rows: list[tuple[int, dict[str, Any]]] = []
    for chunk in iter_records(raw, max(limit, 1)):
        for offset, encoded in enumerate(encode_preference_records(chunk.records, config, tokenizer, chunk.where)):
            if encoded.no_room:
                raise no_room_error(1, 1, chunk.where(offset), config)
            if encoded.row is not None:
                rows.append((chunk.first + offset + 1, encoded.row))
            if len(rows) == limit:
                return rows
    return rows
