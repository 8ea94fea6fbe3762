"""Held-out loss and perplexity of a model on tokenized rows, on one process or many.

Perplexity is exp of the mean loss per label token over the whole set (not a mean of per-batch
perplexities), so it does not depend on how rows are batched or shared out between processes.

Without an `accelerator` (`finetune eval`, the Python API) one process evaluates on the model's own
device; a training run passes its accelerator, whose device, precision and processes it then uses.

Example:
    result = evaluate(model, rows, collate=collate, micro_batch_size=8)   # on the model's device
    result["eval_ppl"]
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from finetune.device import model_device, to_device
from finetune.training.loss import forward_loss


@torch.no_grad()
def evaluate(
    model, rows, *, collate, micro_batch_size: int, accelerator=None, max_batches: int | None = None
) -> dict[str, float]:
    """Mean token loss and perplexity over `rows`, each process taking a strided share.

    Every process runs the same number of forward passes (one with fewer rows repeats a batch and
    discards it): a sharded model's forward is a collective, which a rank with no batch left would hang.
    """
    was_training = model.training
    model.eval()
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    device = accelerator.device if accelerator else model_device(model)
    autocast = accelerator.autocast if accelerator else nullcontext
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = torch.zeros((), dtype=torch.float64, device=device)
    indices = list(range(rank, len(rows), processes))
    batches = [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    batches = batches[:max_batches]
    most = math.ceil(math.ceil(len(rows) / processes) / micro_batch_size)
    for number in range(min(most, max_batches or most)):
        counted = number < len(batches)
        batch_indices = batches[number] if counted else [0]
        batch = to_device(collate([rows[i] for i in batch_indices]), device)
        with autocast():
            batch_loss, batch_tokens = forward_loss(model, batch)
        if counted:
            loss_sum += batch_loss.double()
            num_tokens += batch_tokens.double()
    totals = torch.stack([loss_sum, num_tokens])
    if accelerator is not None:
        totals = accelerator.reduce(totals, reduction="sum")
    model.train(was_training)
    mean_loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"eval_loss": mean_loss, "eval_ppl": math.exp(min(mean_loss, 50.0)), "eval_tokens": int(totals[1].item())}
