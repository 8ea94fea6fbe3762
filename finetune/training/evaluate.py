"""Held-out loss and perplexity of a model on tokenized rows, on one process or many.

Perplexity is exp of the mean loss per label token over the whole set (not a mean of per-batch
perplexities), so it does not depend on how rows are batched or shared out between processes. With a
preference objective (`finetune.training.objectives`) the loss is that objective's, the metrics its own
(`eval_reward_accuracy`, `eval_reward_margin`, ...), and the perplexity that of the chosen (desirable)
completions.

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
from finetune.training.objectives.base import Models, Objective, summarise
from finetune.training.objectives.sft import BATCH_SFT
from finetune.training.sharding import lockstep_batches


@torch.no_grad()
def evaluate(
    model,
    rows,
    *,
    collate,
    micro_batch_size: int,
    accelerator=None,
    max_batches: int | None = None,
    objective: Objective | None = None,
) -> dict[str, float]:
    """Mean loss and perplexity over `rows` (and the objective's metrics), each process taking a strided share.

    Every process runs the same number of forward passes (`lockstep_batches`).
    """
    objective = objective if objective is not None else BATCH_SFT
    models = Models(model, model, accelerator)
    was_training = model.training
    model.eval()
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    device = accelerator.device if accelerator else model_device(model)
    autocast = accelerator.autocast if accelerator else nullcontext
    names = sorted([f"loss/{unit}" for unit in objective.loss_units] + list(objective.metric_units))
    sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in names}
    reported: set[str] = set()  # metrics the model gives (router_aux only for a mixture of experts)
    counts = [0] * len(objective.count_units)
    for batch_indices, counted in lockstep_batches(len(rows), micro_batch_size, rank, processes, max_batches):
        host_batch = collate([rows[i] for i in batch_indices])
        batch = to_device(host_batch, device)
        with autocast():
            terms = objective.terms(models, batch, objective.prepare(models, [batch], reduce=False)[0])
        reported.update(terms.metrics)  # every rank runs every lockstep batch, counted or not: the same names
        if counted:
            batch_counts = objective.counts(host_batch)
            counts = [total + batch_counts[unit] for total, unit in zip(counts, objective.count_units)]
            for name, value in ({f"loss/{u}": v for u, v in terms.losses.items()} | terms.metrics).items():
                sums[name] += value.double()
    model.train(was_training)
    local = torch.cat(
        [torch.stack([sums[name] for name in names]), torch.tensor(counts, dtype=torch.float64, device=device)]
    )
    totals = (accelerator.reduce(local, reduction="sum") if accelerator is not None else local).tolist()
    count_of = dict(zip(objective.count_units, totals[len(names) :]))
    kept = {name: total for name, total in zip(names, totals) if name in reported or name.startswith("loss/")}
    result = summarise(objective, kept, count_of)
    tokens_unit = objective.metric_units["nll"]
    return {"eval_loss": result.pop("loss"), "eval_ppl": result.pop("ppl", math.nan),
            "eval_tokens": int(count_of[tokens_unit]), **{f"eval_{name}": value for name, value in result.items()}}  # fmt: skip
