"""Documents and rows as Arrow stream files, written and read one record batch at a time.

Tokenized data can be larger than memory (a 161 MB corpus is about 500 MB of int32 ids and labels), so
it never exists whole in this process: each encoded chunk is appended to an Arrow IPC stream file, the
format `datasets` keeps its own data in, which `datasets.Dataset.from_file` memory-maps. The files
are read back batch by batch with ordinary reads, not a memory map, so the pages of a pass over them
do not stay resident in this process either.

`partition_rows` makes the rows training reads (`input_ids`, `labels`; a preference format's own columns)
out of a documents file (which also carries `truncated` and `record`), sending each document to the
training or the validation file, and counts the stats of each on the way.

Example:
    with stream_writer(path, DOCUMENT_FEATURES.arrow_schema) as writer:
        writer.write_batch(batch)
    train_stats, validation_stats = partition_rows(path, train_file, validation_file, held_out)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from finetune.data.labels import IGNORE_INDEX


@contextmanager
def stream_writer(path: Path, schema: pa.Schema) -> Iterator[pa.ipc.RecordBatchStreamWriter]:
    """An Arrow IPC stream writer to a new file at `path` (its directory is created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        yield writer


def read_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """The record batches of an Arrow stream file, in order, read (not memory-mapped) one at a time."""
    with pa.OSFile(str(path), "rb") as source, pa.ipc.open_stream(source) as reader:
        yield from reader


@dataclass
class RowCounter:
    """The stats of a sequence of documents (each record's pieces adjacent), counted batch by batch.

    The keys match what the pipeline reports for a split: num_records (records with at least one
    document), num_rows, num_tokens, num_label_tokens, num_truncated (documents cut to max_seq_len) and
    num_split (records split into more than one piece). Tokens and labels are counted over every
    `*input_ids` and `*labels` column (both sequences of a preference pair).
    """

    num_records: int = 0
    num_rows: int = 0
    num_tokens: int = 0
    num_label_tokens: int = 0
    num_truncated: int = 0
    num_split: int = 0
    _last_record: int = -1
    _last_pieces: int = 0

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.num_rows += batch.num_rows
        for name in batch.schema.names:
            if name.endswith("input_ids"):
                self.num_tokens += int(pc.sum(pc.list_value_length(batch.column(name))).as_py() or 0)
            elif name.endswith("labels"):
                labels = pc.list_flatten(batch.column(name))
                self.num_label_tokens += int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
        self.num_truncated += int(pc.sum(batch.column("truncated")).as_py() or 0)
        records = batch.column("record").to_numpy()
        starts = np.flatnonzero(np.diff(records, prepend=self._last_record))  # where a new record begins
        if len(starts) == 0:  # the whole batch continues the last record
            self._last_pieces += len(records)
            return
        self._last_pieces += int(starts[0])  # the pieces that finish the previous record
        self.num_split += self._last_pieces > 1
        runs = np.diff(np.append(starts, len(records)))
        self.num_records += len(runs)
        self.num_split += int(np.sum(runs[:-1] > 1))
        self._last_record, self._last_pieces = int(records[-1]), int(runs[-1])

    def stats(self) -> dict[str, int]:
        last_split = int(self._last_pieces > 1)
        return {
            "num_records": self.num_records,
            "num_rows": self.num_rows,
            "num_tokens": self.num_tokens,
            "num_label_tokens": self.num_label_tokens,
            "num_truncated": self.num_truncated,
            "num_split": self.num_split + last_split,
        }


def partition_rows(
    documents: Path,
    schema: pa.Schema,
    train: Path,
    validation: Path | None = None,
    held_out: np.ndarray | None = None,
) -> tuple[dict[str, int], dict[str, int] | None]:
    """Write the rows of `documents` to `train`, or to `validation` where `held_out[record]` is True.

    Args:
        documents: an Arrow stream of the row columns, `truncated` and `record` (record ids ascending).
        schema: the rows' schema: the documents' columns but `truncated` and `record`.
        train: the training rows file to write.
        validation: the validation rows file; None keeps every document for training.
        held_out: one flag per record id (indexed by the `record` column); needed with `validation`.

    Returns:
        The stats of the training rows, and of the validation rows (None without `validation`).
    """
    counters = [RowCounter(), RowCounter()]
    with stream_writer(train, schema) as train_writer:
        writers = [train_writer]
        with _maybe_writer(validation, schema) as validation_writer:
            if validation_writer is not None:
                writers.append(validation_writer)
            for batch in read_batches(documents):
                if validation_writer is None:
                    parts = [batch]
                else:
                    assert held_out is not None
                    mask = pa.array(held_out[batch.column("record").to_numpy()])
                    parts = [batch.filter(pc.invert(mask)), batch.filter(mask)]
                for part, writer, counter in zip(parts, writers, counters):
                    counter.add(part)
                    rows = pa.RecordBatch.from_arrays([part.column(name) for name in schema.names], schema=schema)
                    writer.write_batch(rows)
    return counters[0].stats(), counters[1].stats() if validation is not None else None


@contextmanager
def _maybe_writer(path: Path | None, schema: pa.Schema) -> Iterator[pa.ipc.RecordBatchStreamWriter | None]:
    if path is None:
        yield None
        return
    with stream_writer(path, schema) as writer:
        yield writer
