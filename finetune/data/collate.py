"""Micro-batches: documents (lists of ints) → the tensors a causal LM's forward takes, plus labels.

A micro-batch is a list of documents, the same ones whether packing is on or off; packing only decides
how they are laid out, so it changes speed, never what a step learns.

- Packing: the documents are packed best-fit decreasing into as few rows as fit, each no longer than
  the micro-batch's longest document (`finetune.data.packing`), so a packed batch never has more rows,
  columns or attention pairs than the padded one: on uniform lengths it is the padded one, on varied
  lengths it drops the padding. (Measured on a 5M-parameter Llama, 1 thread: rows of max_seq_len=512
  instead were no faster on varied lengths, and 1.5x slower than padding on 6 documents of 100-120
  tokens, packed into 2 rows of 443: attention grows with the square of the row.)
  Position ids restart at 0 at each document, and there is no
  `attention_mask`: transformers finds the document boundaries from the position restarts and masks
  attention to each document. This isolates documents only with `use_cache=False` (measured on this
  stack: with the cache on, LoRA gradients were off by a relative 2.2), so the forward must pass it.
  Two layouts:
  - `rows` (default): (R, T), R the rows the documents fill and T the longest row. A shorter row's tail
    is padding laid out as one more document (positions restart at 0, labels -100), so it attends only
    to itself. Attention costs R·T² (sdpa, eager).
  - `one_sequence`: every document concatenated into (1, total_len), no padding at all. This is the
    layout for varlen kernels (flash_attention_2 reads document boundaries from the positions of a
    batch of one); with sdpa/eager it computes a (total_len)² mask and is slower.
  - `bucketed_rows`: `rows`, with T rounded up to a multiple of `ROW_BUCKET` (the tail of every row is
    padding, a document of its own). Under varlen attention (`finetune.training.varlen_attention`) the
    padding costs no attention across documents, and an epoch sees a few widths instead of one per
    longest document: each new shape is a new compiled graph (`train.compile`) or kernel plan.
- No packing: one row per document, padded on the right to the longest with `pad_token_id`, with an
  `attention_mask`, labels -100 on the padding and position ids 0..n-1. Padding is told apart by
  position, never by comparing ids with `pad_token_id`, so EOS stays a trained label even with a
  tokenizer that pads with EOS.

Every key except `labels` is a model input: `model(**{k: v for k, v in batch.items() if k != "labels"},
use_cache=False)`.

Example:
    batch = collate_batch([doc_a, doc_b, doc_c], pad_token_id=tokenizer.pad_token_id, packing=True)
    batch["input_ids"].shape  # (2, 10) for documents of 10, 6 and 4 tokens: [a], [b, c]
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from finetune.data.labels import IGNORE_INDEX
from finetune.data.packing import pack_document_lengths

Document = Mapping[str, Sequence[int]]
Layout = Literal["rows", "one_sequence", "bucketed_rows"]
ROW_BUCKET = 128
"""`bucketed_rows`: row widths are multiples of this (at most 127 padding tokens a row; 16 widths up to 2048)."""


def collate_batch(
    documents: Sequence[Document],
    pad_token_id: int | None,
    packing: bool,
    layout: Layout = "rows",
    row_len: int | None = None,
    document_index: bool = False,
) -> dict[str, torch.Tensor]:
    """Stack the documents of a micro-batch into tensors.

    Args:
        documents: dicts with `input_ids` and `labels` (as `build_datasets` makes them, one per row).
        pad_token_id: token written into padding (needed without packing; a packed row's tail uses it, or 0).
        packing: pack the documents into rows, told apart by their position ids (no attention mask).
        layout: `rows` (R, T), `one_sequence` (1, total_len, with packing) or `bucketed_rows` (T a multiple
            of `ROW_BUCKET`), see the module docstring.
        row_len: with packing in `rows`, the most tokens a row holds; default (and at least) the longest
            document, so the batch is never wider than the padded one.
        document_index: also return `document_index`, (R, T): which of `documents` each position holds
            (-1 for padding); not a model input. Objectives that score whole sequences sum by it. With it
            come the boundaries varlen attention reads (`finetune.training.varlen_attention`): `cu_seq_lens`,
            int32, the cumulative lengths of the flattened (R·T) positions' documents, a row's padding tail
            a document of its own; and `max_length`, the longest of them, a Python int (known on the host).

    Returns:
        `input_ids`, `labels`, `position_ids`, all (R, T) int64, and with packing=False also
        `attention_mask` (then R is the number of documents).
    """
    assert documents, "a micro-batch needs at least one document"
    if document_index:
        documents = [{**d, "document_index": [i] * len(d["input_ids"])} for i, d in enumerate(documents)]
    bucket = ROW_BUCKET if layout == "bucketed_rows" else 1
    if packing and layout == "one_sequence":
        return _padded_rows([_concatenated(documents)], pad_token_id or 0, with_mask=False)
    if packing:
        lengths = [len(document["input_ids"]) for document in documents]
        capacity = max(row_len or 0, *lengths)
        rows = [_concatenated([documents[i] for i in group]) for group in pack_document_lengths(lengths, capacity)]
        return _padded_rows(rows, pad_token_id or 0, with_mask=False, bucket=bucket)
    if pad_token_id is None:
        raise ValueError("collate_batch(packing=False) needs a pad_token_id; give the tokenizer a pad token")
    with_positions: list[Document] = [
        {**document, "position_ids": range(len(document["input_ids"]))} for document in documents
    ]
    return _padded_rows(with_positions, pad_token_id, with_mask=True, bucket=bucket)


def _concatenated(documents: Sequence[Document]) -> dict[str, list[int]]:
    """One row holding `documents` back to back, position ids restarting at 0 at each."""
    return {
        "input_ids": [token for document in documents for token in document["input_ids"]],
        "labels": [label for document in documents for label in document["labels"]],
        "position_ids": [position for document in documents for position in range(len(document["input_ids"]))],
        **(
            {"document_index": [index for document in documents for index in document["document_index"]]}
            if "document_index" in documents[0]
            else {}
        ),
    }


def _padded_rows(
    rows: Sequence[Document], pad_token_id: int, with_mask: bool, bucket: int = 1
) -> dict[str, torch.Tensor]:
    """(R, T) tensors, T the longest row rounded up to a multiple of `bucket`. A shorter row's tail is
    padding: with `with_mask`, masked out by `attention_mask`; without, laid out as a document of its own
    (positions 0.., labels -100)."""
    max_len = bucketed_width(max(len(row["input_ids"]) for row in rows), bucket)
    batch = {
        "input_ids": torch.full((len(rows), max_len), pad_token_id, dtype=torch.long),  # (R, T)
        "labels": torch.full((len(rows), max_len), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.arange(max_len).repeat(len(rows), 1),  # overwritten but for the tails
    }
    if with_mask:
        batch["position_ids"].zero_()
        batch["attention_mask"] = torch.zeros((len(rows), max_len), dtype=torch.long)
    if "document_index" in rows[0]:
        batch["document_index"] = torch.full((len(rows), max_len), -1, dtype=torch.long)
        segments = [length for row in rows for length in _segment_lengths(row["position_ids"], max_len)]
        batch["cu_seq_lens"] = torch.tensor([0, *itertools.accumulate(segments)], dtype=torch.int32)
        batch["max_length"] = max(segments)  # type: ignore[assignment]
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        if "document_index" in row:
            batch["document_index"][index, :length] = torch.tensor(row["document_index"], dtype=torch.long)
        batch["input_ids"][index, :length] = torch.tensor(row["input_ids"], dtype=torch.long)
        batch["labels"][index, :length] = torch.tensor(row["labels"], dtype=torch.long)
        batch["position_ids"][index, :length] = torch.tensor(row["position_ids"], dtype=torch.long)
        if with_mask:
            batch["attention_mask"][index, :length] = 1
        else:
            batch["position_ids"][index, length:] = torch.arange(max_len - length)
    return batch


def bucketed_width(tokens: int, bucket: int) -> int:
    """A row of `tokens` widened to the next multiple of `bucket` (1: unchanged)."""
    return -(-tokens // bucket) * bucket


def _segment_lengths(positions: Sequence[int], row_len: int) -> list[int]:
    """The lengths of a row's documents (each starts where its position is 0), then its padding tail's."""
    starts = [index for index, position in enumerate(positions) if position == 0]
    lengths = [end - start for start, end in zip(starts, [*starts[1:], len(positions)])]
    return lengths + ([row_len - len(positions)] if len(positions) < row_len else [])


def describe_layout(
    lengths: Sequence[Sequence[int]],
    stream,
    packing: bool,
    sample: int = 2000,
    unit: str = "documents",
    bucket: int = 1,
) -> str:
    """One line on how micro-batches are laid out: rows per micro-batch, and the padding computed packed or not.

    Args:
        lengths: tokens of each sequence of each training row (one per document; two per preference pair).
        stream: the `MicroBatchStream` training draws from; its first `sample` micro-batches are measured.
        packing: whether this run packs (the other layout's padding is given beside it).
        unit: what a row is, for the line (`documents`, `pairs`, `examples`).
        bucket: rows are widened to a multiple of this (`bucketed_rows`); the padding counted includes it.
    """
    num_rows = padded = packed = real = sequences = 0
    count = min(stream.micro_batches_per_epoch, sample)
    for position in range(count):
        batch = [n for i in stream.indices(position) for n in lengths[i]]
        groups = pack_document_lengths(batch, max(batch))
        num_rows += len(groups)
        sequences += len(batch)
        real += sum(batch)
        padded += len(batch) * bucketed_width(max(batch), bucket)
        packed += len(groups) * bucketed_width(max(sum(batch[i] for i in group) for group in groups), bucket)
    padding_packed, padding_padded = 1 - real / packed, 1 - real / padded
    per_batch = f"{stream.micro_batch_size} {unit} per micro-batch"
    if len(lengths[0]) > 1:
        per_batch += f" ({sequences / count:.0f} sequences)"
    if packing:
        return (
            f"batches: {per_batch}, packed into {num_rows / count:.1f} "
            f"rows on average; padding computed {padding_packed:.1%} (unpacked: {padding_padded:.1%})"
        )
    return f"batches: {per_batch}, one row each; padding computed {padding_padded:.1%} (packed: {padding_packed:.1%})"
