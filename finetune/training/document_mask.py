"""The attention mask of packed documents, built on the device from the document ids the collator computed.

    mask[r, 0, q, k] = document[r, q] == document[r, k] and k <= q

a (R, 1, T, T) boolean for `sdpa` (True attends), additive (0 or the dtype's lowest) for `eager`, which adds
it to the scores. Padding is a document of its own (positions attend to padding only), so no row of the mask
is empty. `finetune.training.model_inputs` hands it to the model; varlen attention builds it from its
boundaries where it runs inside `torch.compile` on the CPU.

Example:
    mask = document_mask(batch["document_index"])   # (R, 1, T, T) bool
"""

from __future__ import annotations

import torch


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(R, T) document ids -> (R, 1, T, T) bool: a position attends to itself and earlier ones of its document."""
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril_()
    same = documents.unsqueeze(2) == documents.unsqueeze(1)  # (R, T, T)
    return (same & causal).unsqueeze(1)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as `eager` attention adds it to the scores: 0 where True, the dtype's lowest elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
