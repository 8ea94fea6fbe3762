"""Sequence log-probabilities: many sequences in one padding-free forward, summed per sequence by index.

Every preference objective scores whole completions: log π(y|x) = Σ_t log π(y_t | x, y_<t) over the
completion's labelled tokens. Sequences (both completions of each pair, or KTO's examples and their
mismatched KL pairs) are packed into rows as SFT documents are (`finetune.data.collate`: position ids
restart at each sequence, so none attends to another), and all the index work is done on the host at
collation time, so the forward pass never waits on the host:

- `target_index` (N,): the flattened (row · T + t) positions that predict a label, N the labelled tokens;
- `target_ids` (N,): the label each predicts; `target_sequence` (N,): whose sequence it is (0..S-1);
- `sequence_tokens` (S,): labelled tokens per sequence (for length-normalised objectives).

The output head runs only at the N positions, in chunks (`finetune.training.target_loss`), and the
per-sequence sums are one `index_add_` of the N token log-probs: no boolean-mask
indexing, no `.item()`, shapes known before the forward.

Example:
    batch = collate_sequences([{"input_ids": [...], "labels": [...]}, ...], pad_token_id=0, packing=True)
    sums = sequence_logps(model, batch)          # (S,) float32, differentiable
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from finetune.data.collate import Layout, collate_batch
from finetune.data.labels import IGNORE_INDEX
from finetune.scoring import next_token_targets, output_head
from finetune.training.model_inputs import model_inputs
from finetune.training.target_loss import target_losses


def collate_sequences(
    sequences: Sequence[Mapping[str, Sequence[int]]],
    pad_token_id: int | None,
    packing: bool,
    layout: Layout = "rows",
) -> dict[str, torch.Tensor]:
    """Lay out S sequences (`input_ids`, `labels`) as one micro-batch plus the indices that score them.

    Returns:
        The model inputs of `collate_batch` (no `labels`), `document_index` (R, T) for the attention mask
        (`finetune.training.model_inputs`), and `target_index`, `target_ids`,
        `target_sequence` (N,) and `sequence_tokens` (S,), all int64 on the host.
    """
    batch = add_targets(collate_batch(sequences, pad_token_id, packing, layout, document_index=True))
    del batch["labels"]
    owners = batch["document_index"].reshape(-1)  # a target is its own sequence's: first labels are -100
    target_sequence = owners[batch["target_index"]]
    batch["target_sequence"] = target_sequence
    batch["sequence_tokens"] = torch.bincount(target_sequence, minlength=len(sequences))
    return batch


def add_targets(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` with `target_index` and `target_ids` (N,) added, found from its `labels` on the host."""
    targets = next_token_targets(batch["labels"]).reshape(-1)  # (R·T,): position t predicts label t+1
    target_index = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # host tensors: no device sync
    return {**batch, "target_index": target_index, "target_ids": targets[target_index]}


def sequence_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(S,) Σ log π(label) over each sequence's labelled tokens, in float32 (logits upcast before the softmax)."""
    token_logps = -target_losses(model, batch)  # (N,)
    sums = token_logps.new_zeros(batch["sequence_tokens"].shape[0])
    return sums.index_add(0, batch["target_sequence"], token_logps)


def logits_at(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, V) logits at `batch["target_index"]` only, the head run on those positions alone (KV cache off), for
    objectives that need the logits themselves (GRPO: a sampling temperature, the entropy), not only losses.

    Under `torch.compile` (a shape changing every batch would recompile the graph) or without a transformers
    model inside, all logits are computed and the N rows taken from them.
    """
    inputs = model_inputs(model, batch)
    index = batch["target_index"]
    head = output_head(model)
    if head is None or hasattr(model, "_orig_mod"):
        logits = model(**inputs, use_cache=False).logits  # (R, T, V)
        return logits.reshape(-1, logits.size(-1)).index_select(0, index)

    def select(module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # (R, T, H)
        return (hidden.reshape(-1, hidden.size(-1)).index_select(0, index), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        return model(**inputs, use_cache=False).logits  # (N, V)
    finally:
        handle.remove()
