"""The attention mask of packed documents, built on the device from the document ids the collator computed.

    mask[r, 0, q, k] = document[r, q] == document[r, k] and k <= q  (and k > q - window, with a window)

a (R, 1, T, T) boolean for `sdpa` (True attends), additive (0 or the dtype's lowest) for `eager`, which adds
it to the scores. Padding is a document of its own (positions attend to padding only), so no row of the mask
is empty. A sliding-window layer (Mistral, Gemma 2/3, gpt-oss, Phi-3) sees only the last `window` positions
of its document, as transformers' own sliding mask (`sliding_window_overlay`) has it: transformers uses a
given 4D mask as it is, so a mask without the window let those layers attend to the whole document.
`finetune.training.model_inputs` hands it to the model; varlen attention builds it from its
boundaries where it runs inside `torch.compile` on the CPU.

Example:
    mask = document_mask(batch["document_index"])   # (R, 1, T, T) bool
"""

from __future__ import annotations

import torch


def document_mask(documents: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(R, T) document ids -> (R, 1, T, T) bool: a position attends to itself and earlier ones of its document
    (with `window`, only the `window` latest of them, itself included)."""
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril_()
    if window is not None:
        causal.triu_(1 - window)  # k > q - window
    same = documents.unsqueeze(2) == documents.unsqueeze(1)  # (R, T, T)
    return (same & causal).unsqueeze(1)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as `eager` attention adds it to the scores: 0 where True, the dtype's lowest elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
