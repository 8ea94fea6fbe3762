"""Held-out loss and perplexity of a model on tokenized rows, on one process or many.

Perplexity is exp of the mean loss per label token over the whole set (not a mean of per-batch
perplexities), so it does not depend on how rows are batched or shared out between processes.

Example:
    result = evaluate(model, rows, collate=collate, micro_batch_size=8, accelerator=Accelerator(cpu=True))
    result["eval_ppl"]
"""

from __future__ import annotations

import math

import torch

from finetune.loss import token_loss_sum


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_loss(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and label-token count of one collated batch (KV cache off: see packing)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    return token_loss_sum(logits, batch["labels"])


@torch.no_grad()
def evaluate(
    model, rows, *, collate, micro_batch_size: int, accelerator, max_batches: int | None = None
) -> dict[str, float]:
    """Mean token loss and perplexity over `rows`, each process taking a strided share."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    num_tokens = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    indices = list(range(accelerator.process_index, len(rows), accelerator.num_processes))
    batches = [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    for batch_indices in batches[:max_batches]:
        batch = to_device(collate([rows[i] for i in batch_indices]), accelerator.device)
        with accelerator.autocast():
            batch_loss, batch_tokens = forward_loss(model, batch)
        loss_sum += batch_loss.double()
        num_tokens += batch_tokens.double()
    totals = accelerator.reduce(torch.stack([loss_sum, num_tokens]), reduction="sum")
    model.train(was_training)
    mean_loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"eval_loss": mean_loss, "eval_ppl": math.exp(min(mean_loss, 50.0)), "eval_tokens": int(totals[1].item())}
