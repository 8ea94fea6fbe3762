"""Next-token cross-entropy as a (sum, count) pair, so callers can normalise by label tokens.

Averaging per micro-batch and then over micro-batches weights short batches as heavily as long ones;
summing token losses and dividing once by the total number of label tokens (across gradient
accumulation and processes) makes accumulated training equal to one big batch.

Labels follow the Hugging Face convention: aligned with `input_ids`, -100 where no loss is taken; the
shift happens here. In a packed row each document's first label is -100, so no token is ever predicted
from the previous document.

Example:
    loss_sum, num_label_tokens = token_loss_sum(model(input_ids).logits, labels)
    (loss_sum / num_label_tokens).backward()
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of label tokens it covers.

    Args:
        logits: (B, T, V) model outputs; upcast to float32 before the softmax.
        labels: (B, T) target ids aligned with the inputs, IGNORE_INDEX where no loss is taken.

    Returns:
        (loss_sum, num_label_tokens): a float32 scalar and an int64 scalar.
    """
    # Shift the labels, not the logits: slicing logits[:, :-1] would copy the whole (B, T, V) tensor
    # (and its gradient); a label of -100 at the last position drops the prediction past the end.
    shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T): position t predicts token t+1
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (shift_labels != IGNORE_INDEX).sum()


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and label-token count of one collated batch (KV cache off: see packing)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    return token_loss_sum(logits, batch["labels"])
