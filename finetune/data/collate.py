"""Micro-batches: rows (lists of ints) → the tensors a causal LM's forward takes, plus labels.

- Packing (padding-free): the rows of a micro-batch are concatenated into ONE sequence of shape
  (1, total_len) with their restarting `position_ids` and no `attention_mask`. Transformers then finds
  the document boundaries from the position restarts and masks attention to each document; no compute
  is spent on padding. This isolates documents only with `use_cache=False` (measured on this stack: with
  the cache on, LoRA gradients were off by a relative 2.2), so the forward must pass it.
- No packing: rows padded on the right to the longest in the batch with `pad_token_id`, with an
  `attention_mask`, labels -100 on the padding and position ids 0..n-1. Padding is told apart by
  position, never by comparing ids with `pad_token_id`, so EOS stays a trained label even with a
  tokenizer that pads with EOS.

Every key except `labels` is a model input: `model(**{k: v for k, v in batch.items() if k != "labels"},
use_cache=False)`.

Example:
    batch = collate_batch([row_a, row_b], pad_token_id=tokenizer.pad_token_id, packing=True)
    batch["input_ids"].shape  # (1, len(row_a["input_ids"]) + len(row_b["input_ids"]))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from finetune.loss import IGNORE_INDEX


def collate_batch(
    rows: Sequence[Mapping[str, Sequence[int]]], pad_token_id: int | None, packing: bool
) -> dict[str, torch.Tensor]:
    """Stack rows into a micro-batch.

    Args:
        rows: dicts with `input_ids`, `labels` and `position_ids` (as `build_datasets` makes them).
        pad_token_id: token written into padding (unused when packing; needed otherwise).
        packing: concatenate into one padding-free sequence instead of padding.

    Returns:
        `input_ids`, `labels`, `position_ids`, all (B, T) int64, and with packing=False also
        `attention_mask`; with packing B = 1 and T is the total number of tokens.
    """
    assert rows, "a micro-batch needs at least one row"
    if packing:
        return {
            key: torch.tensor([[value for row in rows for value in row[key]]], dtype=torch.long)
            for key in ("input_ids", "labels", "position_ids")
        }
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
