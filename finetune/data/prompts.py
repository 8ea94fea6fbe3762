"""Prompt records -> rows for online objectives (GRPO): `{prompt, ...}`, as trl's GRPOTrainer takes them.

`prompt` is a string (used as written, after BOS when the tokenizer has one, as the preference formats do)
or a list of chat messages (tool calls, tool results and reasoning as `chat` records carry them, and the
record's `tools`), rendered with the family's chat template and its generation prompt
(`finetune.data.formats.encode_chat_prompt`), so the model continues as an assistant. Every other field of
the record is kept, whole, for the reward functions (trl passes each column as a keyword argument), as
JSON text beside the prompt's token ids: a row is `input_ids` (the prompt) and `columns` (the record).

A prompt longer than `data.max_seq_len` is cut to its last max_seq_len tokens, after its BOS (`truncate`: trl
cuts GRPO prompts from the left too, keeping what the completion continues from), or refused (`error`).

Example:
    rows = encode_prompt_records([{"prompt": "2+2=", "answer": "4"}], config, tokenizer, lambda i: f"record {i}")
    rows[0].row     # {"input_ids": [bos, ...], "columns": '{"prompt": "2+2=", "answer": "4"}'}
"""

from __future__ import annotations

import json
from typing import Any

import datasets

from finetune.data.formats import _preview, _tokenize, encode_chat_prompt
from finetune.data.preference import EncodedRecord, Locate
from finetune.data.sources import iter_records, load_source
from finetune.errors import DataError
from finetune.prompting import with_bos
from finetune.recipe import DataConfig

PROMPT_FEATURES = datasets.Features(
    {"input_ids": datasets.Sequence(datasets.Value("int32")), "columns": datasets.Value("string")}
)
"""Columns of a `prompt` row: the prompt's token ids and the whole record as JSON (for the reward functions)."""
REWARD_ARGUMENTS = ("prompts", "completions", "trainer_state", "log_extra", "log_metric")
"""What reward functions are passed besides the columns (`finetune.training.rewards.score`; `completion_ids`, a
column trl drops as it drops `prompt` and `completion`, aside). A column of one of these names would be passed
twice: the call failed with a TypeError that blamed the function and showed an internal module name."""


def prompt_token_ids(prompt: Any, config: DataConfig, tokenizer: Any, where: str, tools: Any = None) -> list[int]:
    """The tokens a completion of `prompt` continues from: a string, or chat messages in any shape `chat`
    records take (tool calls, tool results, reasoning; `tools` the record's function schemas), rendered with
    the generation prompt."""
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: field 'prompt' is empty; give the text the completions continue from")
        return with_bos(tokenizer.bos_token_id, _tokenize(tokenizer, [prompt])[0])  # BOS once, as `text`
    if not isinstance(prompt, list):
        raise DataError(
            f"{where}: field 'prompt' must be a string or a list of {{role, content}} messages, got "
            f"{type(prompt).__name__} {_preview(prompt)}; fix the record"
        )
    return encode_chat_prompt(prompt, config, tokenizer, where, tools)


def encode_prompt_records(
    records: list[dict[str, Any]], config: DataConfig, tokenizer: Any, locate: Locate
) -> list[EncodedRecord]:
    """Encode a batch of records of one source into rows of `PROMPT_FEATURES`.

    Raises:
        DataError: no `prompt` field, a prompt of another type, a field that is not JSON data, a field named as
            an argument reward functions are passed (`REWARD_ARGUMENTS`), or (overlength `error`) a prompt longer
            than max_seq_len.
    """
    encoded = []
    for index, record in enumerate(records):
        where = locate(index)
        if "prompt" not in record:
            fields = ", ".join(sorted(record)) or "none"
            raise DataError(f"{where}: no field 'prompt' (fields: {fields}); data.format prompt reads `prompt`")
        _refuse_reward_arguments(record, where)
        ids = prompt_token_ids(record["prompt"], config, tokenizer, where, record.get(config.tools_field))
        too_long = len(ids) > config.max_seq_len
        if too_long and config.overlength == "error":
            raise DataError(
                f"{where}: the prompt is {len(ids)} tokens, longer than data.max_seq_len={config.max_seq_len}; "
                "raise max_seq_len, shorten the prompt, or set data.overlength=truncate"
            )
        try:
            columns = json.dumps(record, ensure_ascii=False, default=_refuse)
        except TypeError as exc:
            raise DataError(f"{where}: {exc}; prompt records hold JSON values only") from None
        kept = _keep_the_end(ids, config.max_seq_len, getattr(tokenizer, "bos_token_id", None))
        encoded.append(EncodedRecord({"input_ids": kept, "columns": columns}, len(ids), len(kept), too_long, False))
    return encoded


def _refuse_reward_arguments(record: dict[str, Any], where: str) -> None:
    """Refuse a column named as an argument reward functions get (`REWARD_ARGUMENTS`), at loading rather than
    at the first step's scoring, where it was told as the reward function's own error."""
    taken = [name for name in REWARD_ARGUMENTS if name in record]
    if taken:
        raise DataError(
            f"{where}: column '{taken[0]}' has the name of an argument reward functions are passed ("
            f"{', '.join(REWARD_ARGUMENTS)}), so it cannot reach them as a column; rename the column in the data "
            f"(e.g. '{taken[0]}_column') and read it under that name"
        )


def _keep_the_end(ids: list[int], limit: int, bos: int | None) -> list[int]:
    """The prompt cut to `limit` tokens from its start (after a BOS, which stays), from the left as trl's
    `max_prompt_length` cut them (trl 1.16 dropped that setting and cuts nothing): what the completion continues
    from (an instruction's end, the chat template's generation prompt) is kept."""
    if len(ids) <= limit:
        return ids
    head = ids[:1] if bos is not None and ids[0] == bos else []
    return head + ids[len(ids) - (limit - len(head)) :]


def _refuse(value: Any) -> Any:
    raise TypeError(f"a field holds a {type(value).__name__} ({_preview(value)})")


def preview_prompts(config: DataConfig, tokenizer: Any, limit: int) -> list[tuple[int, dict[str, Any]]]:
    """The first `limit` rows of the first source as training sees them, with each record's number (1-based)."""
    raw = load_source(config.train[0], config.text_field)
    rows: list[tuple[int, dict[str, Any]]] = []
    for chunk in iter_records(raw, max(limit, 1)):
        for offset, encoded in enumerate(encode_prompt_records(chunk.records, config, tokenizer, chunk.where)):
            assert encoded.row is not None
            rows.append((chunk.first + offset + 1, encoded.row))
            if len(rows) == limit:
                return rows
    return rows
