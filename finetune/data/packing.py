"""Packing: which documents share a row (best-fit decreasing), and the one-document-per-row datasets.

The dataset training samples from holds one document per row (`document_rows`); the documents of a
micro-batch are packed into rows when it is collated (`finetune.data.collate`), so the batch is the
same documents whether packing is on or off. A packed row holds whole documents and its position ids
restart at 0 at each one. That restart is what isolates documents: fed without an attention mask (and
with the KV cache off), transformers reads the restarts as sequence boundaries
(`find_packed_sequence_indices`) and attends only within each document, so a packed row trains exactly
as its documents would one by one.

Packing is best-fit decreasing: documents longest first (ties in order), each into the fullest row it
still fits, else a new row. It is deterministic, and within 22% of the fewest possible rows in the worst
case (in practice a few percent), where simple greedy filling can waste half of every row.

Example:
    pack_document_lengths([5, 3, 4, 2], max_seq_len=8)  # [[0, 1], [2, 3]]: rows of 8 and 6 tokens
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Sequence

import datasets
import pyarrow as pa
import pyarrow.compute as pc

ROW_FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("int32")),
    }
)
"""Columns of every training and validation row (one document each); int32 halves the cache against int64."""


def pack_document_lengths(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Group document indices into rows of at most `max_seq_len` tokens (best-fit decreasing).

    Args:
        lengths: tokens in each document; every one at most `max_seq_len`.
        max_seq_len: capacity of a row in tokens.

    Returns:
        One list of document indices per row, in the order the documents were placed.
    """
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row index), sorted: the fullest fitting row is found by bisect
    for index in order:
        length = lengths[index]
        assert 0 < length <= max_seq_len, f"document {index} has {length} tokens; max_seq_len is {max_seq_len}"
        slot = bisect.bisect_left(free, (length, -1))
        if slot < len(free):
            space, row = free.pop(slot)
        else:
            space, row = max_seq_len, len(rows)
            rows.append([])
        rows[row].append(index)
        if space - length > 0:
            bisect.insort(free, (space - length, row))
    return rows


def sequence_lengths(rows: datasets.Dataset) -> list[list[int]]:
    """Tokens of each sequence each row holds: one per document row, chosen and rejected for a preference pair
    (every `*input_ids` column), read from Arrow."""
    columns = [name for name in rows.column_names if name.endswith("input_ids")]
    per_column = [pc.list_value_length(rows.data.column(name)).to_pylist() for name in columns]
    return [list(lengths) for lengths in zip(*per_column)]


def arrow_dataset(table: pa.Table) -> datasets.Dataset:
    """An in-memory Dataset over `table`: no cache files, no per-value casting, no hashing of the table."""
    return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=uuid.uuid4().hex)


def document_rows(documents: datasets.Dataset) -> datasets.Dataset:
    """The rows training samples from: one document per row, `input_ids` and `labels` (int32)."""
    return arrow_dataset(documents.data.table.select(["input_ids", "labels"]).cast(ROW_FEATURES.arrow_schema))
