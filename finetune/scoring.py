"""Scoring text with a causal LM: next-token loss as a (sum, count) pair, and perplexity over rows.

This is the inference half's scoring (`finetune eval`, the Python API); training's objectives build on
the same functions, so a loss reported at evaluation is computed exactly as the one trained on. It
imports nothing of training.

Averaging per micro-batch and then over micro-batches weights short batches as heavily as long ones;
summing token losses and dividing once by the total number of label tokens (across gradient
accumulation and processes) makes accumulated training equal to one big batch.

Labels follow the Hugging Face convention: aligned with `input_ids`, -100 where no loss is taken; the
shift happens here. In a packed row each document's first label is -100, so no token is ever predicted
from the previous document.

Example:
    loss_sum, num_label_tokens = token_loss_sum(model(input_ids).logits, labels)
    (loss_sum / num_label_tokens).backward()
    perplexity(model, rows, collate=collate, micro_batch_size=8)["eval_ppl"]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from finetune.data.labels import IGNORE_INDEX
from finetune.device import model_device, to_device


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B, T) targets: position t predicts token t+1, IGNORE_INDEX where no loss is taken."""
    # Shift the labels, not the logits: slicing logits[:, :-1] would copy the whole (B, T, V) tensor
    # (and its gradient); a label of -100 at the last position drops the prediction past the end.
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of label tokens it covers.

    Args:
        logits: (B, T, V) model outputs; upcast to float32 before the softmax.
        labels: (B, T) target ids aligned with the inputs, IGNORE_INDEX where no loss is taken.

    Returns:
        (loss_sum, num_label_tokens): a float32 scalar and an int64 scalar.
    """
    targets = next_token_targets(labels)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (targets != IGNORE_INDEX).sum()


def forward_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and label-token count of one collated batch (see `forward_loss_terms`; without
    a mixture of experts' load-balancing loss)."""
    loss_sum, num_label_tokens, _ = forward_loss_terms(model, batch)
    return loss_sum, num_label_tokens


def forward_loss_terms(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Summed next-token loss, label-token count, and the router's load-balancing loss of one collated batch.

    The output layer runs only at the positions that predict a label: with a prompt masked out (or
    padding) most positions carry none, and for a large vocabulary the head and its softmax are most of
    a small model's step. The loss is the same sum over the same tokens as `token_loss_sum` of all
    logits. The selection happens in a hook on the head, inside the model's forward, so DDP, FSDP and
    DeepSpeed wrappers see an ordinary forward. KV cache off: see packing.

    A mixture of experts whose config sets `output_router_logits` returns its load-balancing loss
    (transformers' `aux_loss`, one value per micro-batch). Training adds it as transformers' own loss adds
    it, `router_aux_loss_coef` x aux per token (`router_aux_coef`), so weighted by this micro-batch's label
    tokens: the step's loss is then the mean cross-entropy plus the coefficient times the token-weighted
    mean aux. The third value is that aux x label tokens, None for other models; the first is the
    cross-entropy alone, so scores and perplexities never include it.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = next_token_targets(batch["labels"])  # (B, T)
    labelled = targets != IGNORE_INDEX
    head = output_head(model)
    if head is None or hasattr(model, "_orig_mod"):  # torch.compile: a shape that changes every batch recompiles
        outputs = model(**inputs, use_cache=False)
        loss_sum, num_label_tokens = token_loss_sum(outputs.logits, batch["labels"])
    else:
        handle = head.register_forward_pre_hook(lambda module, args: (args[0][labelled], *args[1:]))
        try:
            outputs = model(**inputs, use_cache=False)  # logits (N, V): the N labelled positions, in row order
        finally:
            handle.remove()
        loss_sum = F.cross_entropy(outputs.logits.float(), targets[labelled], reduction="sum")
        num_label_tokens = labelled.sum()
    aux = getattr(outputs, "aux_loss", None)
    if aux is None:
        return loss_sum, num_label_tokens, None
    return loss_sum, num_label_tokens, aux.float() * num_label_tokens


def transformers_model(model: torch.nn.Module) -> PreTrainedModel | None:
    """The first transformers model inside `model` (itself, or what a wrapper holds: peft, DDP, FSDP,
    DeepSpeed); None when there is none."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None


def router_aux_coef(model: torch.nn.Module) -> float:
    """The model config's weight of the load-balancing loss (`router_aux_loss_coef`, 0 when it names none)."""
    inner = transformers_model(model)
    return 0.0 if inner is None else float(getattr(inner.config, "router_aux_loss_coef", 0.0) or 0.0)


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer (hidden states -> logits) of the causal LM inside `model`, under any wrapper
    (peft, DDP, FSDP, DeepSpeed); None when there is no transformers model inside."""
    inner = transformers_model(model)
    return None if inner is None else inner.get_output_embeddings()


def perplexity_of(mean_loss: float) -> float:
    """exp of a mean next-token loss: the perplexity, inf past float range (a mean above about 709.78, a
    diverged or badly scaled model) instead of an OverflowError, NaN for NaN.

    The one formula for `finetune eval` and training's evaluation, so both print the same figure for the same
    loss (a cap at exp(50) in training alone had training report 5.2e21 where `eval` crashed or printed the
    true value).
    """
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def perplexity(
    model: torch.nn.Module,
    rows: Sequence[dict[str, Any]],
    *,
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]],
    micro_batch_size: int,
) -> dict[str, float]:
    """Mean loss per label token over all `rows` and its exp, on the model's device, in one process.

    Perplexity is exp of the mean over the whole set (not a mean of per-batch perplexities), so it does
    not depend on how rows are batched. Training's evaluation (`finetune.training.evaluate`) computes the
    same figure for any objective and any number of processes.
    """
    was_training = model.training
    model.eval()
    device = model_device(model)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    num_label_tokens = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, len(rows), micro_batch_size):
        batch_rows = [rows[i] for i in range(start, min(start + micro_batch_size, len(rows)))]
        batch = to_device(collate(batch_rows), device)
        batch_loss, batch_tokens = forward_loss(model, batch)
        loss_sum += batch_loss.double()
        num_label_tokens += batch_tokens
    model.train(was_training)
    loss, tokens = loss_sum.item(), int(num_label_tokens.item())
    mean = loss / tokens if tokens else math.nan
    return {"eval_loss": mean, "eval_ppl": perplexity_of(mean) if tokens else math.nan, "eval_tokens": tokens}
