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
from transformers import PreTrainedModel

from finetune.data.labels import IGNORE_INDEX


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
    """Summed next-token loss and label-token count of one collated batch (see `forward_loss_terms`)."""
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
    (transformers' `aux_loss`, one value per micro-batch); it is added as transformers' own loss adds it,
    `router_aux_loss_coef` x aux per token, so weighted by this micro-batch's label tokens here: the
    step's loss is then the mean cross-entropy plus the coefficient times the token-weighted mean aux.
    The third value is aux x label tokens (for the `router_aux` metric), None for other models.
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
    weighted_aux = aux.float() * num_label_tokens
    return loss_sum + router_aux_coef(model) * weighted_aux, num_label_tokens, weighted_aux.detach()


def router_aux_coef(model: torch.nn.Module) -> float:
    """The model config's weight of the load-balancing loss (`router_aux_loss_coef`, 0 when it names none)."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return float(getattr(module.config, "router_aux_loss_coef", 0.0) or 0.0)
    return 0.0


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output layer (hidden states -> logits) of the causal LM inside `model`, under any wrapper
    (peft, DDP, FSDP, DeepSpeed); None when there is no transformers model inside."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module.get_output_embeddings()
    return None
