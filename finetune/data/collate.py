"""Micro-batches: rows (lists of ints) → the tensors a causal LM's forward takes, plus labels.

- Packing: rows keep their restarting `position_ids` and get no `attention_mask`; transformers finds
  the document boundaries from the position restarts and masks attention to each document. This
  isolates documents only with `use_cache=False` (measured on this stack: with the cache on, LoRA
  gradients were off by a relative 2.2), so the forward must pass it. Two layouts:
  - `rows` (default): (B, T), T the longest row. A shorter row's tail is padding laid out as one more
    document (positions restart at 0, labels -100), so it attends only to itself. Best-fit packing
    fills rows nearly full, so little is spent on the tail, and attention costs B·T² (sdpa, eager).
  - `one_sequence`: every row concatenated into (1, total_len), no padding at all. This is the layout
    for varlen kernels (flash_attention_2 reads document boundaries from the positions of a batch of
    one); with sdpa/eager it computes a (B·T)² mask and was 1.4x slower per step (bench/).
- No packing: rows padded on the right to the longest in the batch with `pad_token_id`, with an
  `attention_mask`, labels -100 on the padding and position ids 0..n-1. Padding is told apart by
  position, never by comparing ids with `pad_token_id`, so EOS stays a trained label even with a
  tokenizer that pads with EOS.

Every key except `labels` is a model input: `model(**{k: v for k, v in batch.items() if k != "labels"},
use_cache=False)`.

Example:
    batch = collate_batch([row_a, row_b], pad_token_id=tokenizer.pad_token_id, packing=True)
    batch["input_ids"].shape  # (2, max(len(row_a["input_ids"]), len(row_b["input_ids"])))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from finetune.loss import IGNORE_INDEX


def collate_batch(
    rows: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int | None,
    packing: bool,
    layout: Literal["rows", "one_sequence"] = "rows",
) -> dict[str, torch.Tensor]:
    """Stack rows into a micro-batch.

    Args:
        rows: dicts with `input_ids`, `labels` and `position_ids` (as `build_datasets` makes them).
        pad_token_id: token written into padding (unused when packing; needed otherwise).
        packing: the rows hold packed documents, told apart by their position ids (no attention mask).
        layout: with packing, `rows` (B, T) or `one_sequence` (1, total_len), see the module docstring.

    Returns:
        `input_ids`, `labels`, `position_ids`, all (B, T) int64, and with packing=False also
        `attention_mask`.
    """
    assert rows, "a micro-batch needs at least one row"
    if packing and layout == "one_sequence":
        return {
            key: torch.tensor([[value for row in rows for value in row[key]]], dtype=torch.long)
            for key in ("input_ids", "labels", "position_ids")
        }
    if packing:
        return _packed_rows(rows, pad_token_id)
    if pad_token_id is None:
        raise ValueError("collate_batch(packing=False) needs a pad_token_id; give the tokenizer a pad token")
    max_len = max(len(row["input_ids"]) for row in rows)
    batch = {
        "input_ids": torch.full((len(rows), max_len), pad_token_id, dtype=torch.long),  # (B, T)
        "labels": torch.full((len(rows), max_len), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), max_len), dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), max_len), dtype=torch.long),
    }
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        batch["input_ids"][index, :length] = torch.tensor(row["input_ids"], dtype=torch.long)
        batch["labels"][index, :length] = torch.tensor(row["labels"], dtype=torch.long)
        batch["position_ids"][index, :length] = torch.tensor(row["position_ids"], dtype=torch.long)
        batch["attention_mask"][index, :length] = 1
    return batch


def _packed_rows(rows: Sequence[Mapping[str, Sequence[int]]], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """(B, T) packed rows; each row's padded tail is a document of its own (positions 0.., labels -100)."""
    max_len = max(len(row["input_ids"]) for row in rows)
    batch = {
        "input_ids": torch.full((len(rows), max_len), pad_token_id or 0, dtype=torch.long),  # (B, T)
        "labels": torch.full((len(rows), max_len), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.arange(max_len).repeat(len(rows), 1),  # overwritten but for the tails
    }
    for index, row in enumerate(rows):
        length = len(row["input_ids"])
        batch["input_ids"][index, :length] = torch.tensor(row["input_ids"], dtype=torch.long)
        batch["labels"][index, :length] = torch.tensor(row["labels"], dtype=torch.long)
        batch["position_ids"][index, :length] = torch.tensor(row["position_ids"], dtype=torch.long)
        batch["position_ids"][index, length:] = torch.arange(max_len - length)
    return batch
