"""The data pipeline: labels per format, every source type, validation, overlength (split, truncate,
error), collation packed and padded, cache, fingerprint, errors.

Everything goes through the public `build_datasets` with a real tokenizer and real files in tmp_path;
each row of its result is one document (packing happens per micro-batch, in `collate_batch`).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import finetune.data.pipeline as pipeline
from finetune.data.cache import data_fingerprint
from finetune.data.collate import collate_batch
from finetune.data.labels import IGNORE_INDEX
from finetune.data.packing import pack_document_lengths
from finetune.data.pipeline import build_datasets
from finetune.embedded.tokenizer import CHAT_TEMPLATE, train_tokenizer
from finetune.errors import DataError
from finetune.recipe import DataConfig

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the model"},
    {"role": "assistant", "content": "reads a document"},
    {"role": "user", "content": "and"},
    {"role": "assistant", "content": "predicts"},
]
UNMARKED_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
assert UNMARKED_CHAT_TEMPLATE != CHAT_TEMPLATE


def write_records(path: Path, records: list[dict]) -> str:
    """Write `records` in the format `path`'s extension names; returns the path as a string."""
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif suffix == ".json":
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    elif suffix == ".csv":
        datasets.Dataset.from_list(records).to_csv(str(path), index=False)
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    elif suffix == ".txt":
        path.write_text("\n\n\n".join(r["text"] for r in records) + "\n", encoding="utf-8")
    else:
        raise AssertionError(suffix)
    return str(path)


def build(tmp_path: Path, tokenizer, **config):
    """build_datasets with the cache in tmp_path; `config` fields override a packing=False text config."""
    seed = config.pop("seed", 0)
    return build_datasets(
        DataConfig(**{"packing": False, **config}), tokenizer, seed=seed, cache_dir=tmp_path / "cache"
    )


def decode_labelled(tokenizer, row) -> str:
    return tokenizer.decode([label for label in row["labels"] if label != IGNORE_INDEX])


# ---------------------------------------------------------------------------------------------------
# Labels, format by format


INSTRUCTION = {"instruction": "add two numbers", "input": "", "output": "return a + b"}
INSTRUCTION_WITH_INPUT = {"instruction": "add", "input": "a and b", "output": "a + b"}

LABEL_CASES = [
    # (id, config, record, full decoded row, decoded labelled tokens)
    (
        "text",
        {"format": "text"},
        {"text": "the model reads\na document"},
        "<s>the model reads\na document</s>",
        "the model reads\na document</s>",
    ),
    (
        "instruction",
        {"format": "instruction"},
        INSTRUCTION,
        "<s>### Instruction:\nadd two numbers\n\n### Response:\nreturn a + b</s>",
        "return a + b</s>",
    ),
    (
        "instruction-with-input",
        {"format": "instruction"},
        INSTRUCTION_WITH_INPUT,
        "<s>### Instruction:\nadd\n\n### Input:\na and b\n\n### Response:\na + b</s>",
        "a + b</s>",
    ),
    (
        "instruction-all-tokens",
        {"format": "instruction", "completion_only_loss": False},
        INSTRUCTION,
        "<s>### Instruction:\nadd two numbers\n\n### Response:\nreturn a + b</s>",
        "### Instruction:\nadd two numbers\n\n### Response:\nreturn a + b</s>",
    ),
    (
        "instruction-braces-in-template",
        {"format": "instruction", "prompt_template": '{"q": {prompt}}\n'},
        {"instruction": "{input}", "output": "ok"},
        '<s>{"q": {input}}\nok</s>',
        "ok</s>",
    ),
    (
        "text-with-its-own-bos-and-eos",  # e.g. a chat rendered to text: BOS and EOS once each, never twice
        {"format": "text"},
        {"text": "<s>the model reads</s>"},
        "<s>the model reads</s>",
        "the model reads</s>",
    ),
    (
        "instruction-with-bos-in-template-and-eos-in-response",
        {"format": "instruction", "prompt_template": "<s>{prompt}\n"},
        {"instruction": "add", "output": "a + b</s>"},
        "<s>add\na + b</s>",
        "a + b</s>",
    ),
    (
        "chat-generation-markers",
        {"format": "chat"},
        {"messages": CHAT},
        "<s><|system|>\nbe brief</s>\n<|user|>\nthe model</s>\n<|assistant|>\nreads a document</s>\n<|user|>\nand</s>\n"
        "<|assistant|>\npredicts</s>\n",
        "reads a document</s>predicts</s>",
    ),
    (
        "chat-template-without-markers",
        {"format": "chat", "chat_template": UNMARKED_CHAT_TEMPLATE},
        {"messages": CHAT},
        "<s><|system|>\nbe brief</s>\n<|user|>\nthe model</s>\n<|assistant|>\nreads a document</s>\n<|user|>\nand</s>\n"
        "<|assistant|>\npredicts</s>\n",
        "reads a document</s>predicts</s>",
    ),
    (
        "chat-all-tokens",
        {"format": "chat", "completion_only_loss": False},
        {"messages": CHAT[:3]},
        "<s><|system|>\nbe brief</s>\n<|user|>\nthe model</s>\n<|assistant|>\nreads a document</s>\n",
        "<|system|>\nbe brief</s>\n<|user|>\nthe model</s>\n<|assistant|>\nreads a document</s>\n",
    ),
]


@pytest.mark.parametrize(
    ("config", "record", "full_text", "labelled_text"),
    [case[1:] for case in LABEL_CASES],
    ids=[case[0] for case in LABEL_CASES],
)
def test_labels_cover_exactly_what_is_trained(tmp_path, tiny_tokenizer, config, record, full_text, labelled_text):
    source = write_records(tmp_path / "data.jsonl", [record])
    row = build(tmp_path, tiny_tokenizer, train=[source], **config).train[0]
    assert tiny_tokenizer.decode(row["input_ids"]) == full_text
    assert decode_labelled(tiny_tokenizer, row) == labelled_text
    assert row["labels"][0] == IGNORE_INDEX, "a document's first token is never a target"
    assert tiny_tokenizer.eos_token_id in row["labels"], "EOS must stay a trained label"
    assert all(label in (IGNORE_INDEX, token) for label, token in zip(row["labels"], row["input_ids"]))
    assert set(row) == {"input_ids", "labels"}


def test_chat_labels_agree_with_and_without_generation_markers(tmp_path, tiny_tokenizer):
    conversations = [{"messages": CHAT}, {"messages": CHAT[1:3]}, {"messages": [CHAT[2], CHAT[1], CHAT[4]]}]
    source = write_records(tmp_path / "chat.jsonl", conversations)
    marked = build(tmp_path, tiny_tokenizer, train=[source], format="chat").train
    unmarked = build(
        tmp_path, tiny_tokenizer, train=[source], format="chat", chat_template=UNMARKED_CHAT_TEMPLATE
    ).train
    assert marked["labels"] == unmarked["labels"] and marked["input_ids"] == unmarked["input_ids"]


def test_records_with_nothing_to_train_on_are_dropped_and_counted(tmp_path, tiny_tokenizer):
    records = [{"messages": CHAT[:2]}, {"messages": CHAT}]  # the first has no assistant turn
    source = write_records(tmp_path / "chat.jsonl", records)
    lines: list[str] = []
    bundle = build_datasets(
        DataConfig(train=[source], format="chat"), tiny_tokenizer, cache_dir=tmp_path, log=lines.append
    )
    assert (bundle.stats["num_records"], bundle.stats["num_dropped"]) == (1, 1)
    assert any("dropped 1 of 2 records" in line for line in lines)


# ---------------------------------------------------------------------------------------------------
# Sources


RECORDS = [{"text": "the model reads"}, {"text": "a document"}, {"text": "and predicts\nthe next token"}]


def _saved_dataset(tmp_path: Path) -> str:
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
    return str(tmp_path / "saved")


def _saved_dataset_dict(tmp_path: Path) -> str:
    splits = {"train": datasets.Dataset.from_list(RECORDS[:1]), "test": datasets.Dataset.from_list(RECORDS)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "saved_dict"))
    return str(tmp_path / "saved_dict")


def _json_lines_named_json(tmp_path: Path) -> str:
    path = tmp_path / "lines.json"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    return str(path)


SOURCE_CASES = {
    "jsonl": lambda tmp: {"path": write_records(tmp / "d.jsonl", RECORDS)},
    "json-array": lambda tmp: {"path": write_records(tmp / "d.json", RECORDS)},
    "json-lines-in-.json": lambda tmp: {"path": _json_lines_named_json(tmp)},
    "csv": lambda tmp: {"path": write_records(tmp / "d.csv", RECORDS)},
    "parquet": lambda tmp: {"path": write_records(tmp / "d.parquet", RECORDS)},
    "txt-blank-line-separated": lambda tmp: {"path": write_records(tmp / "d.txt", RECORDS)},
    "saved-dataset": lambda tmp: {"path": _saved_dataset(tmp)},
    "saved-dataset-dict-split": lambda tmp: {"path": _saved_dataset_dict(tmp), "split": "test"},
}


@pytest.mark.parametrize("make_source", SOURCE_CASES.values(), ids=SOURCE_CASES.keys())
def test_every_source_type_loads_its_records_in_order(tmp_path, tiny_tokenizer, make_source):
    bundle = build(tmp_path, tiny_tokenizer, train=[make_source(tmp_path)])
    texts = [tiny_tokenizer.decode(row["input_ids"][1:-1]) for row in bundle.train]
    assert texts == [record["text"] for record in RECORDS]


def test_json_file_holding_one_object_on_one_line_is_one_record(tmp_path, tiny_tokenizer):
    source = tmp_path / "one.json"
    source.write_text(json.dumps(RECORDS[0]), encoding="utf-8")
    assert build(tmp_path, tiny_tokenizer, train=[str(source)]).stats["num_records"] == 1


def test_saved_dataset_dict_reads_train_split_by_default(tmp_path, tiny_tokenizer):
    bundle = build(tmp_path, tiny_tokenizer, train=[_saved_dataset_dict(tmp_path)])
    assert bundle.stats["num_records"] == 1


def test_max_records_reads_a_prefix_of_each_source(tmp_path, tiny_tokenizer):
    first = write_records(tmp_path / "a.jsonl", RECORDS)
    second = write_records(tmp_path / "b.csv", RECORDS)
    bundle = build(
        tmp_path, tiny_tokenizer, train=[{"path": first, "max_records": 2}, {"path": second, "max_records": 1}]
    )
    texts = [tiny_tokenizer.decode(row["input_ids"][1:-1]) for row in bundle.train]
    assert texts == [RECORDS[0]["text"], RECORDS[1]["text"], RECORDS[0]["text"]]


# ---------------------------------------------------------------------------------------------------
# Validation


MANY = [{"text": f"the model reads document {i}"} for i in range(20)]


def _split_texts(tmp_path, tokenizer, seed: int) -> tuple[list[str], list[str]]:
    source = write_records(tmp_path / "many.jsonl", MANY)
    bundle = build(tmp_path, tokenizer, train=[source], validation_split=0.25, seed=seed)
    decode = lambda rows: [tokenizer.decode(row["input_ids"][1:-1]) for row in rows]
    return decode(bundle.train), decode(bundle.validation)


def test_validation_split_is_seeded_and_disjoint(tmp_path, tiny_tokenizer):
    train, validation = _split_texts(tmp_path, tiny_tokenizer, seed=0)
    assert len(validation) == 5 and len(train) == 15
    assert sorted(train + validation) == sorted(r["text"] for r in MANY)
    assert _split_texts(tmp_path, tiny_tokenizer, seed=0) == (train, validation)
    assert _split_texts(tmp_path, tiny_tokenizer, seed=1)[1] != validation


def test_validation_sources_and_no_validation(tmp_path, tiny_tokenizer):
    train = write_records(tmp_path / "train.jsonl", MANY)
    held_out = write_records(tmp_path / "valid.jsonl", RECORDS)
    lines: list[str] = []
    config = DataConfig(train=[train], validation=[held_out], validation_split=0.5, packing=False)
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache", log=lines.append)
    assert (bundle.stats["num_records"], bundle.stats["validation_num_records"]) == (20, 3)
    assert "data: data.validation is given, so data.validation_split=0.5 is not used" in lines
    assert bundle.validation.column_names == bundle.train.column_names == ["input_ids", "labels"]
    assert build(tmp_path, tiny_tokenizer, train=[train]).validation is None


# ---------------------------------------------------------------------------------------------------
# Overlength


LONG = [{"text": "short"}, {"text": " ".join(["the model reads a document"] * 10)}, {"text": "the model " * 20}]


def _encoded_text(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def _text_of_tokens(tokenizer, count: int) -> str:
    """A text that encodes (with BOS and EOS) to exactly `count` tokens: one token per word here."""
    text = " ".join(["the"] * (count - 2))
    assert len(_encoded_text(tokenizer, text)) == count
    return text


def test_split_keeps_every_token_in_consecutive_pieces(tmp_path, tiny_tokenizer):
    """A record of 3.5 x max_seq_len is 4 pieces; concatenated they are the record, EOS only at the end."""
    max_seq_len = 16
    text = _text_of_tokens(tiny_tokenizer, 56)
    source = write_records(tmp_path / "long.jsonl", [{"text": "short"}, {"text": text}])
    lines: list[str] = []
    config = DataConfig(train=[source], max_seq_len=max_seq_len)
    assert config.overlength == "split", "split is the default for text"
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path, log=lines.append)
    pieces = bundle.train[1:]
    assert [len(ids) for ids in pieces["input_ids"]] == [16, 16, 16, 8]
    original = _encoded_text(tiny_tokenizer, text)
    assert [token for ids in pieces["input_ids"] for token in ids] == original
    eos = tiny_tokenizer.eos_token_id
    assert [ids.count(eos) for ids in pieces["input_ids"]] == [0, 0, 0, 1] and pieces["input_ids"][-1][-1] == eos
    assert [ids[0] == tiny_tokenizer.bos_token_id for ids in pieces["input_ids"]] == [True, False, False, False]
    for ids, labels in zip(pieces["input_ids"], pieces["labels"]):
        assert labels == [IGNORE_INDEX, *ids[1:]], "each piece trains on all its tokens but the first"
    stats = bundle.stats
    assert (stats["num_records"], stats["num_rows"], stats["num_split"], stats["num_truncated"]) == (2, 5, 1, 0)
    assert stats["num_tokens"] == len(original) + len(_encoded_text(tiny_tokenizer, "short"))
    assert any(f"1 of 2 records longer than max_seq_len=16: split into 4 pieces, all {stats['num_tokens']} tokens kept"
               in line for line in lines), lines  # fmt: skip


def test_split_never_leaves_a_piece_of_one_token(tmp_path, tiny_tokenizer):
    text = _text_of_tokens(tiny_tokenizer, 33)
    source = write_records(tmp_path / "long.jsonl", [{"text": text}])
    bundle = build(tmp_path, tiny_tokenizer, train=[source], max_seq_len=16)
    assert [len(ids) for ids in bundle.train["input_ids"]] == [16, 15, 2]
    assert bundle.train["labels"][-1] == [IGNORE_INDEX, tiny_tokenizer.eos_token_id], "EOS stays trained"


def test_validation_split_keeps_the_pieces_of_a_record_together(tmp_path, tiny_tokenizer):
    records = [{"text": _text_of_tokens(tiny_tokenizer, 40)} for _ in range(6)]
    records = [{"text": f"{i} " + r["text"]} for i, r in enumerate(records)]
    source = write_records(tmp_path / "long.jsonl", records)
    bundle = build(tmp_path, tiny_tokenizer, train=[source], max_seq_len=16, validation_split=0.34)
    first_tokens = lambda rows: {tuple(ids[:3]) for ids in rows["input_ids"] if ids[0] == tiny_tokenizer.bos_token_id}
    assert bundle.stats["validation_num_records"] == 2 and bundle.stats["num_records"] == 4
    assert bundle.stats["validation_num_rows"] + bundle.stats["num_rows"] == 6 * 3
    assert len(first_tokens(bundle.validation)) == 2 and not first_tokens(bundle.validation) & first_tokens(
        bundle.train
    )


def test_truncate_cuts_long_records_and_counts_them(tmp_path, tiny_tokenizer):
    source = write_records(tmp_path / "long.jsonl", LONG)
    lines: list[str] = []
    config = DataConfig(train=[source], max_seq_len=16, overlength="truncate")
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path, log=lines.append)
    assert bundle.stats["num_truncated"] == 2 and bundle.stats["num_split"] == 0
    lengths = [len(_encoded_text(tiny_tokenizer, record["text"])) for record in LONG]
    assert [len(ids) for ids in bundle.train["input_ids"]] == [lengths[0], 16, 16] and min(lengths[1:]) > 16
    kept, total = lengths[0] + 32, sum(lengths)
    message = f"truncated 2 of 3 records to max_seq_len=16 tokens: kept {kept} of {total} tokens ({kept / total:.1%}"
    assert any(message in line and "overlength=split would keep all" in line for line in lines), lines

    again: list[str] = []  # the rows from the cache: the same truncation is said again, the stats are the same
    cached = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path, log=again.append)
    assert cached.cache_hit and cached.stats == bundle.stats and "notes" not in bundle.stats
    assert [line for line in again if message in line] == [line for line in lines if message in line], again


def test_split_is_refused_where_a_piece_is_no_example_of_the_task():
    with pytest.raises(ValueError, match="data.overlength=split applies to format text only"):
        DataConfig(train=["a.jsonl"], format="instruction", overlength="split")
    assert DataConfig(train=["a.jsonl"], format="chat").overlength == "truncate"


def test_truncation_that_leaves_no_response_drops_the_record(tmp_path, tiny_tokenizer):
    records = [INSTRUCTION, {"instruction": "the model reads " * 10, "output": "ok"}]
    source = write_records(tmp_path / "long.jsonl", records)
    bundle = build(tmp_path, tiny_tokenizer, train=[source], format="instruction", max_seq_len=48)
    assert (bundle.stats["num_records"], bundle.stats["num_dropped"], bundle.stats["num_truncated"]) == (1, 1, 0)
    assert decode_labelled(tiny_tokenizer, bundle.train[0]) == "return a + b</s>"


def test_an_empty_response_is_dropped_and_counted_and_preview_says_so(tmp_path, tiny_tokenizer):
    """An empty answer would train the end token alone (stopping at once): training drops such a record like
    empty text, and `data preview` shows it as dropped rather than leaving it out without a word."""
    from finetune.data.pipeline import preview_documents

    records = [{**INSTRUCTION, "output": " \n"}, INSTRUCTION]
    source = write_records(tmp_path / "empty.jsonl", records)
    config = DataConfig(train=[source], format="instruction", max_seq_len=48)
    lines: list[str] = []
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path, log=lines.append)
    assert (bundle.stats["num_records"], bundle.stats["num_dropped"]) == (1, 1)
    assert decode_labelled(tiny_tokenizer, bundle.train[0]) == "return a + b</s>"
    assert any("dropped 1 of 2 records" in line and "the first: " in line and "line 1 (record 1)" in line
               for line in lines), lines  # fmt: skip
    dropped, shown = preview_documents(config, tiny_tokenizer, limit=2)
    assert (dropped.record, dropped.dropped, dropped.input_ids) == (1, True, [])
    assert (shown.record, shown.dropped) == (2, False) and shown.input_ids
    assert len(preview_documents(config, tiny_tokenizer, limit=1)) == 1


def test_overlength_error_names_file_and_record(tmp_path, tiny_tokenizer):
    source = write_records(tmp_path / "long.jsonl", LONG)
    with pytest.raises(
        DataError, match=r"long\.jsonl line 2 \(record 2\): \d+ tokens, longer than data\.max_seq_len=16"
    ) as caught:
        build(tmp_path, tiny_tokenizer, train=[source], max_seq_len=16, overlength="error")
    assert "\n" not in str(caught.value) and "split or truncate" in str(caught.value)


# ---------------------------------------------------------------------------------------------------
# Packing and collation


def test_packing_lays_out_the_same_documents_in_fewer_rows(tmp_path, tiny_tokenizer):
    """Rows are documents whatever `packing` says; a packed micro-batch holds exactly its documents, whole."""
    varied = [{"text": " ".join(["the"] * n)} for n in (1, 20, 3, 7, 2, 15, 4, 9, 1, 12, 5, 2, 18, 6, 3, 10)]
    source = write_records(tmp_path / "varied.jsonl", varied)
    packed = build(tmp_path, tiny_tokenizer, train=[source], packing=True, max_seq_len=32)
    single = build(tmp_path, tiny_tokenizer, train=[source], packing=False, max_seq_len=32)
    assert packed.fingerprint == single.fingerprint and packed.train.to_dict() == single.train.to_dict()
    documents = list(single.train)
    for first in range(0, len(documents), 8):
        micro_batch = documents[first : first + 8]
        batch = collate_batch(micro_batch, pad_token_id=tiny_tokenizer.pad_token_id, packing=True)
        longest = max(len(document["input_ids"]) for document in micro_batch)
        assert batch["input_ids"].shape[0] < len(micro_batch) and batch["input_ids"].shape[1] == longest
        found = []
        for ids, labels, positions in zip(*(batch[key].tolist() for key in ("input_ids", "labels", "position_ids"))):
            for token, label, position in zip(ids, labels, positions):
                if position == 0:
                    assert label == IGNORE_INDEX, "a packed document is predicted from the previous one"
                    found.append(([], []))
                found[-1][0].append(token)
                found[-1][1].append(label)
        real = [document for document in found if any(label != IGNORE_INDEX for label in document[1])]
        padding = [document for document in found if all(label == IGNORE_INDEX for label in document[1])]
        assert sorted(real) == sorted((d["input_ids"], d["labels"]) for d in micro_batch)
        assert all(set(ids) == {tiny_tokenizer.pad_token_id} for ids, _ in padding)
        unpacked = collate_batch(micro_batch, pad_token_id=tiny_tokenizer.pad_token_id, packing=False)
        assert unpacked["input_ids"].shape[0] == len(micro_batch)
        assert int((unpacked["labels"] != IGNORE_INDEX).sum()) == int((batch["labels"] != IGNORE_INDEX).sum())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=60), st.integers(64, 128))
def test_best_fit_decreasing_places_every_document_once_within_capacity(lengths, max_seq_len):
    rows = pack_document_lengths(lengths, max_seq_len)
    assert sorted(index for row in rows for index in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= max_seq_len for row in rows)
    # No two rows could be merged: best fit never leaves two rows that together fit in one.
    totals = sorted(sum(lengths[i] for i in row) for row in rows)
    assert len(totals) < 2 or totals[0] + totals[1] > max_seq_len
    assert rows == pack_document_lengths(lengths, max_seq_len)


def test_pack_document_lengths_example():
    assert pack_document_lengths([5, 3, 4, 2], max_seq_len=8) == [[0, 1], [2, 3]]


def test_collate_padding_free_and_padded(tiny_tokenizer):
    eos, pad = tiny_tokenizer.eos_token_id, tiny_tokenizer.pad_token_id
    documents = [
        {"input_ids": [0, 7, eos], "labels": [-100, 7, eos]},
        {"input_ids": [0, eos], "labels": [-100, eos]},
        {"input_ids": [0, 9, eos], "labels": [-100, 9, eos]},
    ]
    one_sequence = collate_batch(documents, pad_token_id=pad, packing=True, layout="one_sequence")
    assert {key: value.tolist() for key, value in one_sequence.items()} == {
        "input_ids": [[0, 7, eos, 0, eos, 0, 9, eos]],
        "labels": [[-100, 7, eos, -100, eos, -100, 9, eos]],
        "position_ids": [[0, 1, 2, 0, 1, 0, 1, 2]],
    }
    packed_rows = collate_batch(documents, pad_token_id=pad, packing=True, row_len=5)  # a tail is a document
    assert {key: value.tolist() for key, value in packed_rows.items()} == {
        "input_ids": [[0, 7, eos, 0, eos], [0, 9, eos, pad, pad]],
        "labels": [[-100, 7, eos, -100, eos], [-100, 9, eos, -100, -100]],
        "position_ids": [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]],
    }
    no_wider_than_padded = collate_batch(documents, pad_token_id=pad, packing=True)  # rows of the longest: 3
    assert no_wider_than_padded["input_ids"].tolist() == [[0, 7, eos], [0, 9, eos], [0, eos, pad]]
    padded = collate_batch(documents[2:] + documents[1:2], pad_token_id=pad, packing=False)
    assert {key: value.tolist() for key, value in padded.items()} == {
        "input_ids": [[0, 9, eos], [0, eos, pad]],
        "labels": [[-100, 9, eos], [-100, eos, -100]],
        "position_ids": [[0, 1, 2], [0, 1, 0]],
        "attention_mask": [[1, 1, 1], [1, 1, 0]],
    }
    padded_with_eos = collate_batch(documents[2:] + documents[1:2], pad_token_id=eos, packing=False)
    assert padded_with_eos["labels"].tolist() == [[-100, 9, eos], [-100, eos, -100]], "EOS must stay a label"


# ---------------------------------------------------------------------------------------------------
# Cache and fingerprint


def test_second_run_loads_the_cache_and_tokenizes_nothing(tmp_path, tiny_tokenizer, monkeypatch):
    source = write_records(tmp_path / "many.jsonl", MANY)
    config = DataConfig(train=[source], validation_split=0.2)
    calls = {"encode": 0, "load": 0}

    def counting(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(pipeline, "encode_records", counting("encode", pipeline.encode_records))
    monkeypatch.setattr(pipeline, "load_source", counting("load", pipeline.load_source))
    first = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert not first.cache_hit and calls == {"encode": 1, "load": 1}
    second = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert second.cache_hit and calls == {"encode": 1, "load": 1}, "the second run read or tokenized the data again"
    assert second.fingerprint == first.fingerprint and second.stats == first.stats
    assert second.train.to_dict() == first.train.to_dict() and second.validation.to_dict() == first.validation.to_dict()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.fingerprint.removeprefix("sha256:")]


def test_use_cache_false_writes_nothing(tmp_path, tiny_tokenizer):
    config = DataConfig(train=[write_records(tmp_path / "many.jsonl", MANY)])
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache", use_cache=False)
    assert bundle.cache_path is None and not bundle.cache_hit and not (tmp_path / "cache").exists()
    assert bundle.fingerprint == data_fingerprint(config, tiny_tokenizer, seed=0)


def test_damaged_cache_entry_is_rebuilt(tmp_path, tiny_tokenizer):
    source = write_records(tmp_path / "many.jsonl", MANY)
    config = DataConfig(train=[source])
    first = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    for arrow_file in (first.cache_path / "train").glob("*.arrow"):
        arrow_file.unlink()
    again = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert not again.cache_hit and again.stats == first.stats


def test_cache_entry_with_rows_cut_off_is_rebuilt(tmp_path, tiny_tokenizer):
    """A rows file cut at a record batch boundary reads without error as fewer rows; it was served as the
    whole entry (the log saying every row was loaded), so training silently ran on part of the data."""
    records = [{"text": f"document number {i}"} for i in range(2 * pipeline._RECORDS_PER_CHUNK + 5)]
    config = DataConfig(train=[write_records(tmp_path / "many.jsonl", records)], max_seq_len=64)
    first = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    rows_file = first.cache_path / "train" / "data.arrow"
    with pa.OSFile(str(rows_file), "rb") as source:
        pa.ipc.open_stream(source).read_next_batch()
        first_batch_end = source.tell()
    with open(rows_file, "r+b") as handle:
        handle.truncate(first_batch_end)
    again = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert not again.cache_hit and len(again.train) == first.stats["num_rows"] == len(records)


_BUILD_THEN_HANG = """
import sys, time
from pathlib import Path
from finetune.data import cache

def build(staging):
    (staging / "train").mkdir()
    (staging / "train" / "data.arrow").write_bytes(b"half written")
    print("building", flush=True)
    time.sleep(600)

cache.store(Path(sys.argv[1]), "sha256:" + "ab" * 32, build, {})
"""


def test_a_killed_builds_staging_directory_is_removed_by_the_next_build(tmp_path, tiny_tokenizer):
    """SIGKILL (or SIGTERM before training handles it) runs no cleanup: each kill while tokenizing left its
    staging directory, up to the whole tokenized corpus, in the cache for good."""
    cache_root = tmp_path / "cache"
    killed = subprocess.Popen(
        [sys.executable, "-c", _BUILD_THEN_HANG, str(cache_root)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(pipeline.__file__).parents[2])},  # this checkout's package
    )
    assert killed.stdout.readline() == b"building\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (left,) = cache_root.glob(".tmp-*")
    running = cache_root / f".tmp-{'cd' * 8}-{os.getpid()}-00000000-{socket.gethostname()}"  # a live build's
    running.mkdir()
    config = DataConfig(train=[write_records(tmp_path / "many.jsonl", MANY)])
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=cache_root)
    assert not left.exists() and running.exists()
    assert sorted(p.name for p in cache_root.iterdir()) == sorted([running.name, bundle.cache_path.name])


@pytest.fixture(scope="module")
def other_tokenizer():
    from helpers import tokenizer_corpus

    return train_tokenizer(tokenizer_corpus(), vocab_size=400, max_model_len=512)


def _append_record(config, data_file: Path, tokenizer):
    with open(data_file, "a", encoding="utf-8") as handle:
        handle.write('{"text": "one more"}\n')
    return config, tokenizer


def _other_chat_template(tokenizer):
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = UNMARKED_CHAT_TEMPLATE
    return changed


def _used_with_truncation_and_padding(config, data_file: Path, tokenizer):
    used = copy.deepcopy(tokenizer)
    used(["the model reads"] * 2, truncation=True, max_length=2, padding="max_length")  # leaves backend state
    return config, used


FINGERPRINT_CASES = [
    # (id, change to (config dict, data file, tokenizer), whether the fingerprint must change)
    ("file-content", _append_record, True),
    ("max_seq_len", lambda c, f, t: ({**c, "max_seq_len": 256}, t), True),
    ("packing-lays-out-batches-only", lambda c, f, t: ({**c, "packing": False}, t), False),
    ("overlength", lambda c, f, t: ({**c, "overlength": "error"}, t), True),
    ("text_field", lambda c, f, t: ({**c, "text_field": "body"}, t), True),
    ("max_records", lambda c, f, t: ({**c, "train": [{"path": str(f), "max_records": 1}]}, t), True),
    ("validation_split", lambda c, f, t: ({**c, "validation_split": 0.1}, t), True),
    ("tokenizer", lambda c, f, t: (c, "other"), True),
    ("tokenizer-chat-template", lambda c, f, t: (c, _other_chat_template(t)), True),
    ("same-config", lambda c, f, t: (dict(c), t), False),
    ("moved-file", lambda c, f, t: ({**c, "train": [str(f.rename(f.with_name("moved.jsonl")))]}, t), False),
    ("field-of-another-format", lambda c, f, t: ({**c, "prompt_field": "question", "messages_field": "m"}, t), False),
    ("completion-only-irrelevant-to-text", lambda c, f, t: ({**c, "completion_only_loss": False}, t), False),
    ("tokenizer-after-a-truncating-call", _used_with_truncation_and_padding, False),
    ("seed-without-validation-split", lambda c, f, t: ({**c, "seed": 7}, t), False),
]


@pytest.mark.parametrize(
    ("change", "changes"), [case[1:] for case in FINGERPRINT_CASES], ids=[c[0] for c in FINGERPRINT_CASES]
)
def test_fingerprint_changes_exactly_when_the_result_can(tmp_path, tiny_tokenizer, other_tokenizer, change, changes):
    data_file = tmp_path / "data.jsonl"
    write_records(data_file, MANY)
    config = {"train": [str(data_file)], "max_seq_len": 128}
    before = data_fingerprint(DataConfig(**config), tiny_tokenizer, seed=0)
    new_config, tokenizer = change(config, data_file, tiny_tokenizer)
    tokenizer = other_tokenizer if tokenizer == "other" else tokenizer
    seed = new_config.pop("seed", 0)
    after = data_fingerprint(DataConfig(**new_config), tokenizer, seed=seed)
    assert (after != before) is changes
    assert before.startswith("sha256:") and len(before) == len("sha256:") + 64


def test_fingerprint_tracks_the_seed_when_a_validation_split_is_taken(tmp_path, tiny_tokenizer):
    config = DataConfig(train=[write_records(tmp_path / "d.jsonl", MANY)], validation_split=0.2)
    assert data_fingerprint(config, tiny_tokenizer, seed=0) != data_fingerprint(config, tiny_tokenizer, seed=1)


# ---------------------------------------------------------------------------------------------------
# Bad input: one DataError line saying what, where and how to fix


def _file(name: str, content: str | bytes):
    def make(tmp: Path) -> str:
        path = tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    return make


def _directory(tmp: Path) -> str:
    (tmp / "plain_dir").mkdir()
    (tmp / "plain_dir" / "notes.md").write_text("hi")
    return str(tmp / "plain_dir")


BAD_INPUT_CASES = [
    # (id, make source -> path or source dict, config fields, fragments the message must contain)
    ("missing-file", lambda tmp: str(tmp / "nope.jsonl"), {}, ["nope.jsonl", "does not exist"]),
    ("unsupported-extension", _file("data.xml", "<a/>"), {}, ["data.xml", "unsupported extension '.xml'", ".jsonl"]),
    ("not-a-saved-dataset", _directory, {}, ["plain_dir", "not one written by datasets.save_to_disk"]),
    ("garbage-parquet", _file("d.parquet", b"not parquet at all"), {}, ["d.parquet", "cannot be read as Parquet"]),
    ("invalid-json-line", _file("d.jsonl", '{"text": "a"}\n{"text": \n'), {}, ["d.jsonl line 2", "invalid JSON"]),
    ("json-not-an-array", _file("d.json", '"just a string"'), {}, ["d.json", "expected a JSON array", "got str"]),
    (
        "json-object-not-an-array",
        _file("d.json", '{\n "data": []\n}'),
        {},
        ["d.json", "expected a JSON array", "got an object"],
    ),
    ("invalid-json", _file("d.json", '[{"text": "a"},\n {"text": }]'), {}, ["d.json line 2", "invalid JSON"]),
    (
        "invalid-json-lines-in-.json",
        _file("d.json", '{"text": "a"}\n{"text": }\n'),
        {},
        ["d.json line 2", "invalid JSON"],
    ),
    (
        "record-not-an-object",
        _file("d.jsonl", '{"text": "a"}\n[1, 2]\n'),
        {},
        ["d.jsonl line 2 (record 2)", "got list"],
    ),
    ("ragged-csv", _file("d.csv", "text,extra\na,b\nc,d,e\n"), {}, ["d.csv line 3", "3 values", "header has 2"]),
    (
        "csv-quote-never-closed",  # read silently as one record holding every later row
        _file("d.csv", 'text\nfirst\n"second, never closed\nthird\nfourth\n'),
        {},
        ["d.csv line 3", "never closed"],
    ),
    (
        "non-utf8",
        _file("d.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
        {},
        ["d.jsonl", "not valid UTF-8", "byte 0xe9", "byte offset 28", "line 2"],
    ),
    (
        "lone-surrogate-jsonl",  # text cut inside an emoji: json.loads takes it, the tokenizer raised a TypeError
        _file("d.jsonl", '{"text": "ok \\ud83d\\ude00"}\n\n{"text": "cut \\ud83d"}\n'),
        {},
        ["d.jsonl line 3 (record 2)", "lone surrogate"],
    ),
    (
        "lone-surrogate-json",
        _file("d.json", '[{"text": "ok"}, {"text": "cut \\uDE00 here"}]'),
        {},
        ["d.json record 2", "lone surrogate"],
    ),
    ("empty-file", _file("d.jsonl", "\n\n"), {}, ["d.jsonl", "has no records"]),
    (
        "empty-after-filtering",
        _file("d.jsonl", '{"text": ""}\n{"text": "  "}\n'),
        {},
        ["d.jsonl", "no usable records", "all 2 were dropped"],
    ),
    (
        "missing-text-field",
        _file("d.jsonl", '{"text": "a"}\n{"body": "b", "id": 2}\n'),
        {},
        ["d.jsonl line 2 (record 2)", "no field 'text'", "fields it has: 'body', 'id'", "data.text_field"],
    ),
    (
        "missing-response-field",
        _file("d.json", '[{"instruction": "a", "output": "b"}, {"instruction": "c"}]'),
        {"format": "instruction"},
        ["d.json record 2", "no field 'output'", "fields it has: 'instruction'", "data.response_field"],
    ),
    (
        "null-prompt",
        _file("d.jsonl", '{"instruction": null, "output": "b"}\n'),
        {"format": "instruction"},
        ["record 1", "field 'instruction' is null"],
    ),
    (
        "text-not-a-string",
        _file("d.jsonl", '{"text": 5}\n'),
        {},
        ["record 1", "field 'text' must be a string, got int"],
    ),
    (
        "input-not-a-string",
        _file("d.jsonl", '{"instruction": "a", "input": [1], "output": "b"}\n'),
        {"format": "instruction"},
        ["record 1", "field 'input' must be a string, got list"],
    ),
    (
        "messages-not-a-list",
        _file("d.jsonl", '{"messages": "hello"}\n'),
        {"format": "chat"},
        ["d.jsonl line 1 (record 1)", "field 'messages' must be a non-empty list", "got str"],
    ),
    (
        "missing-messages",
        _file("d.jsonl", '{"conversation": []}\n'),
        {"format": "chat"},
        ["record 1", "no field 'messages'", "fields it has: 'conversation'", "data.messages_field"],
    ),
    (
        "message-without-content",
        _file("d.jsonl", '{"messages": [{"role": "user"}]}\n'),
        {"format": "chat"},
        ["record 1", "messages[0].content must be a string, got missing"],
    ),
    (
        "chat-template-not-locatable",
        _file("d.jsonl", json.dumps({"messages": CHAT}) + "\n"),
        {
            "format": "chat",
            # the total length of every message comes first: the text before a turn depends on its words
            "chat_template": "{{ messages|map(attribute='content')|join|length }}{% for m in messages %}"
            "{{ m['content'] }}{% endfor %}",
        },
        ["d.jsonl line 1 (record 1)", "assistant turns cannot be located", "{% generation %}"],
    ),
    (
        "chat-template-error",
        _file("d.jsonl", json.dumps({"messages": CHAT}) + "\n"),
        {"format": "chat", "chat_template": "{{ raise_exception('roles must alternate') }}"},
        ["record 1", "cannot render this conversation", "roles must alternate"],
    ),
    (
        "split-on-a-file",
        lambda tmp: {"path": write_records(tmp / "d.jsonl", RECORDS), "split": "test"},
        {},
        ["d.jsonl", "'split' only applies"],
    ),
    (
        "missing-split",
        lambda tmp: {"path": _saved_dataset_dict(tmp), "split": "validation"},
        {},
        ["saved_dict", "no split 'validation'", "test, train"],
    ),
    (
        "validation-split-too-large",
        lambda tmp: write_records(tmp / "d.jsonl", RECORDS[:1]),
        {"validation_split": 0.5},
        ["validation_split=0.5", "leaves none for training"],
    ),
]


@pytest.mark.parametrize(
    ("make_source", "config", "fragments"),
    [case[1:] for case in BAD_INPUT_CASES],
    ids=[case[0] for case in BAD_INPUT_CASES],
)
def test_bad_input_raises_one_line_data_error(tmp_path, tiny_tokenizer, make_source, config, fragments):
    with pytest.raises(DataError) as caught:
        build(tmp_path, tiny_tokenizer, train=[make_source(tmp_path)], **config)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_chat_without_any_template_says_how_to_fix(tmp_path, tiny_tokenizer):
    no_template = copy.deepcopy(tiny_tokenizer)
    no_template.chat_template = None
    source = write_records(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match="tokenizer has no chat template; set data.chat_template"):
        build(tmp_path, no_template, train=[source], format="chat")


def _cached_hub_dataset(hub_cache: Path, repo_id: str, records: list[dict]) -> None:
    """A dataset repository laid out in the local hub cache as `hf download --repo-type dataset` leaves it."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / f"datasets--{repo_id.replace('/', '--')}"
    data = repo / "snapshots" / revision / "data"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_a_hub_dataset_in_the_local_cache_is_read_offline(tmp_path, tiny_tokenizer, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _cached_hub_dataset(tmp_path / "hub", "acme/crates", RECORDS)
    config = DataConfig(train=["acme/crates"], format="text", max_seq_len=128)
    bundle = build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert bundle.stats["num_records"] == len(RECORDS)

    missing = DataConfig(train=["acme/absent"], format="text", max_seq_len=128)
    with pytest.raises(DataError, match=r"acme/absent.*offline.*hf download --repo-type dataset acme/absent"):
        build_datasets(missing, tiny_tokenizer, cache_dir=tmp_path / "cache")


def test_each_subset_of_a_cached_hub_dataset_has_its_own_cache_entry(tmp_path, tiny_tokenizer, monkeypatch):
    """The snapshot's bytes hold every subset, so only `subset` tells two of them apart: without it in the
    fingerprint, the second subset was served the first one's cached rows."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _cached_hub_dataset(tmp_path / "hub", "acme/mix", RECORDS)
    snapshot = next((tmp_path / "hub" / "datasets--acme--mix" / "snapshots").iterdir())
    write_records(snapshot / "data" / "other.jsonl", [{"text": "an other subset entirely"}])
    configs = "".join(
        f"- config_name: {name}\n  data_files:\n  - split: train\n    path: data/{name}.jsonl\n"
        for name in ("train", "other")
    )
    (snapshot / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    built = [
        build_datasets(
            DataConfig(train=[{"path": "acme/mix", "subset": subset}], format="text", max_seq_len=128),
            tiny_tokenizer,
            cache_dir=tmp_path / "cache",
        )
        for subset in ("train", "other")
    ]
    assert [bundle.stats["num_records"] for bundle in built] == [len(RECORDS), 1]
    assert not built[1].cache_hit and built[0].fingerprint != built[1].fingerprint


def test_data_preview_shows_the_pieces_training_uses(tmp_path, tiny_tokenizer, tiny_base_dir, capsys, monkeypatch):
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    source = write_records(tmp_path / "long.jsonl", [{"text": "short"}, {"text": _text_of_tokens(tiny_tokenizer, 40)}])
    recipe = f"model: {{base: {tiny_base_dir}}}\ndata: {{train: {source}, max_seq_len: 16}}\noutput: {{name: x}}\n"
    (tmp_path / "recipe.yaml").write_text(recipe)
    assert main(["data", "preview", "recipe.yaml", "--limit", "10", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    trained = build(tmp_path, tiny_tokenizer, train=[source], max_seq_len=16).train
    assert [(d["input_ids"], d["labels"]) for d in shown] == list(zip(trained["input_ids"], trained["labels"]))
    assert [(d["record"], d["piece"], d["pieces"]) for d in shown] == [(1, 1, 1), (2, 1, 3), (2, 2, 3), (2, 3, 3)]
    assert main(["data", "preview", "recipe.yaml", "--limit", "2"]) == 0
    assert "--- document 2: 16 tokens, 15 trained, piece 1 of 3 of record 2" in capsys.readouterr().out

    assert main(["data", "preview", "recipe.yaml", "data.format=instruction", "data.overlength=split"]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert "data.overlength=split applies to format text only" in error


CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_tokenizer_changed_in_place_between_builds_masks_as_one_loaded_so(tmp_path, tiny_tokenizer):
    """A tokenizer given a new EOS in place (a notebook adding a special token) after a build in the same process:
    the template's probes were cached by the tokenizer object, so the new EOS closing each assistant turn went
    untrained, and those rows were cached under the fingerprint a fresh process computes and loads."""
    source = write_records(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    config = {"train": [source], "format": "chat", "chat_template": UNMARKED_CHAT_TEMPLATE}
    changed, fresh = copy.deepcopy(tiny_tokenizer), copy.deepcopy(tiny_tokenizer)
    build(tmp_path, changed, **config)  # probes the template with `changed` as it is now
    for tokenizer in (changed, fresh):
        tokenizer.add_special_tokens({"eos_token": "<|halt|>"})
    after = build(tmp_path, changed, **config)
    expected = build(tmp_path / "fresh", fresh, **config)
    assert after.train[0] == expected.train[0]
    assert changed.eos_token_id in after.train[0]["labels"]


def test_a_turn_closer_the_vocabulary_lacks_is_refused_unless_eos_follows(tmp_path, tiny_tokenizer):
    """ChatML on a base without `<|im_end|>` (a Llama or Mistral base): the closer was trained as several ordinary
    tokens and the tuned model never stopped; with EOS after it, the model learns to stop on EOS."""
    assert len(tiny_tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1
    source = write_records(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"closes an assistant turn with '<\|im_end\|>', which this tokenizer has no"):
        build(tmp_path, tiny_tokenizer, train=[source], format="chat", chat_template=CHATML_TEMPLATE)
    with_eos = CHATML_TEMPLATE.replace("'<|im_end|>' +", "'<|im_end|>' + eos_token +")
    bundle = build(tmp_path, tiny_tokenizer, train=[source], format="chat", chat_template=with_eos)
    labels = [label for label in bundle.train[0]["labels"] if label != IGNORE_INDEX]
    assert labels[-1] == tiny_tokenizer.eos_token_id
