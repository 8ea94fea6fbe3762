"""Streaming data preparation: chunked reading, worker processes and Arrow files change nothing in the rows.

The reference here is the pipeline's meaning written out without streaming: every record of every source
read whole, encoded in one call, cut by `overlength`, numbered across sources, and the validation split
drawn from the kept records with the seeded permutation. The pipeline under test runs with chunks of
two records (so chunks straddle sources and pieces), two worker processes, and a tiny read block.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import finetune.data.pipeline as pipeline
import finetune.data.sources as sources
from finetune.data.formats import encode_records
from finetune.data.overlength import fit_to_length
from finetune.data.pipeline import build_datasets
from finetune.data.rowfiles import RowCounter
from finetune.errors import DataError
from finetune.recipe import DataConfig

LONG = "def f(x):\n    return x + 1\n" * 12  # several pieces at max_seq_len 64
TEXTS = [LONG, "short one", "   ", "café ünïcode\r\nwith a CRLF", LONG[:90], "x", "y = 2\n" * 20, "last"]


def _write_sources(tmp_path: Path) -> list[str]:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS), encoding="utf-8")
    txt = tmp_path / "b.txt"
    txt.write_bytes(("\ufeff" + "\n\n".join(t.replace("\n\n", "\n") for t in TEXTS if t.strip()) + "\n").encode())
    return [str(jsonl), str(txt)]


def _reference(config: DataConfig, tokenizer, seed: int) -> tuple[list[tuple], list[tuple]]:
    """(train, validation) rows as (input_ids, labels), computed whole and in one process."""
    documents, record = [], 0
    for source in config.train:
        raw = sources.load_source(source, config.text_field)
        records = [r for chunk in sources.iter_records(raw, 10**9) for r in chunk.records]
        for document in encode_records(records, config, tokenizer, locate=str):
            pieces, _ = fit_to_length(document, config, "")
            documents += [(record, piece.input_ids, piece.labels) for piece in pieces]
            record += 1
    kept = sorted({r for r, _, _ in documents})
    order = np.random.default_rng(seed).permutation(len(kept))
    held = {kept[i] for i in order[: max(1, round(config.validation_split * len(kept)))]}
    train = [(ids, labels) for r, ids, labels in documents if r not in held]
    validation = [(ids, labels) for r, ids, labels in documents if r in held]
    return train, validation


def _rows(dataset) -> list[tuple]:
    return list(zip(dataset.data.column("input_ids").to_pylist(), dataset.data.column("labels").to_pylist()))


@pytest.mark.parametrize("num_proc", [1, 2])
def test_streamed_rows_equal_the_whole_corpus_reference(tmp_path, tiny_tokenizer, monkeypatch, num_proc):
    monkeypatch.setattr(pipeline, "_RECORDS_PER_CHUNK", 2)
    monkeypatch.setattr(pipeline, "_CHARS_PER_CHUNK", 40)
    monkeypatch.setattr(sources, "_READ_BLOCK_BYTES", 16)
    config = DataConfig(train=_write_sources(tmp_path), max_seq_len=64, validation_split=0.3, num_proc=num_proc)
    bundle = build_datasets(config, tiny_tokenizer, seed=5, cache_dir=tmp_path / "cache")
    train, validation = _reference(config, tiny_tokenizer, seed=5)
    assert len(train) > 10 and len(validation) > 3
    assert _rows(bundle.train) == train
    assert _rows(bundle.validation) == validation
    stats = bundle.stats
    assert (stats["num_rows"], stats["validation_num_rows"], stats["num_dropped"]) == (len(train), len(validation), 1)
    assert stats["num_tokens"] == sum(len(ids) for ids, _ in train)
    assert stats["num_split"] + stats["validation_num_split"] == 4  # LONG twice, "y = 2" twice (blank lines dropped)


def test_the_first_bad_record_in_file_order_is_reported_from_a_worker(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(pipeline, "_RECORDS_PER_CHUNK", 2)
    lines = [json.dumps({"text": f"record {i}"}) for i in range(12)]
    lines[6] = json.dumps({"body": "no text field"})  # an encoding error, found in a worker
    lines[10] = "{not json"  # a reading error, found later in the main process
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = DataConfig(train=[str(tmp_path / "d.jsonl")], num_proc=2)
    with pytest.raises(DataError) as caught:
        build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache")
    assert "d.jsonl line 7 (record 7): no field 'text'" in str(caught.value)
    assert not list((tmp_path / "cache").iterdir()), "a failed build left files in the cache"


def test_max_records_stops_reading_before_the_rest_of_the_file(tmp_path, tiny_tokenizer):
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{broken\n', encoding="utf-8")
    config = DataConfig(train=[{"path": str(tmp_path / "d.jsonl"), "max_records": 2}])
    assert build_datasets(config, tiny_tokenizer, cache_dir=tmp_path / "cache").stats["num_records"] == 2


@pytest.mark.parametrize("block_bytes", [1, 3, 1 << 20])
def test_blocks_split_into_the_lines_of_the_whole_text(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(sources, "_READ_BLOCK_BYTES", block_bytes)
    text = "\ufeffa\r\nbé\rc\n\nd\u2028e" + "long" * 50 + "\n\n"
    (tmp_path / "t.txt").write_bytes(text.encode())
    blocks = list(sources._utf8_blocks(tmp_path / "t.txt", "t.txt"))
    assert "".join(blocks) == text[1:] and [line for b in blocks for line in b.splitlines()] == text[1:].splitlines()
    (tmp_path / "bad.txt").write_bytes("\ufeffok\nnext\nab".encode() + b"\xff\n")
    with pytest.raises(DataError, match=r"byte 0xff at byte offset 13 \(line 3\)"):
        list(sources._utf8_blocks(tmp_path / "bad.txt", "bad.txt"))


def test_row_counter_counts_a_record_whose_pieces_span_batches():
    def batch(records: list[int]) -> pa.RecordBatch:
        n = len(records)
        return pa.RecordBatch.from_pydict(
            {"input_ids": [[1, 2]] * n, "labels": [[-100, 2]] * n, "truncated": [False] * n, "record": records}
        )

    counter = RowCounter()
    for records in ([0, 1, 1], [1], [1, 2, 3, 3], [3]):
        counter.add(batch(records))
    stats = counter.stats()
    assert (stats["num_records"], stats["num_split"], stats["num_rows"]) == (4, 2, 9)
    assert (stats["num_tokens"], stats["num_label_tokens"]) == (18, 9)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0c", "\x1d"])
def test_unicode_line_separators_inside_records_are_text_not_line_breaks(tmp_path, separator):
    """JSON strings may hold U+2028/U+2029/U+0085 unescaped (json.dumps(ensure_ascii=False) writes them), and a
    .txt document may hold them or a form feed: str.splitlines would break the record (or the document) there."""
    texts = [f"one{separator}two", "three"]
    (tmp_path / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\r\n" for t in texts), encoding="utf-8"
    )
    (tmp_path / "a.json").write_text(json.dumps({"text": texts[0]}, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "a.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    for name, expected in (("a.jsonl", texts), ("a.json", texts[:1]), ("a.txt", texts)):
        raw = sources.load_source(DataConfig(train=str(tmp_path / name)).train[0], "text")
        chunks = list(sources.iter_records(raw, 10))
        assert [r["text"] for chunk in chunks for r in chunk.records] == expected, name
    assert chunks[0].where(1).endswith("line 3 (record 2)")


def test_long_records_end_a_chunk_in_every_kind_of_source(tmp_path):
    """`chunk_chars` bounds a chunk's text for records read whole too (Parquet rows, `.json` array items, saved
    datasets): they counted 0 characters, so a chunk took `chunk_records` long documents whatever their size."""
    import datasets
    import pyarrow.parquet as pq

    records = [{"text": f"{i} " + "word " * 2_000, "meta": {"tags": ["a" * 500]}} for i in range(9)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    (tmp_path / "a.json").write_text(json.dumps(records), encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    for name in ("a.jsonl", "a.json", "a.parquet", "saved"):
        raw = sources.load_source(DataConfig(train=str(tmp_path / name)).train[0], "text")
        chunks = list(sources.iter_records(raw, 1000, chunk_chars=25_000))
        assert [len(chunk.records) for chunk in chunks] == [3, 3, 3], name  # 10,500 characters a record
        assert [r for chunk in chunks for r in chunk.records] == records, name
