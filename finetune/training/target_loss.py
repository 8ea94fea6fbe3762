"""Token losses at a batch's labelled positions, indexed on the host, the logits computed in chunks.

Every objective scores the same thing: −log π(label) at the positions that predict a label. The collator
computes on the host where those are (`target_index`, the flattened row · T + t positions, and `target_ids`,
the labels; `finetune.training.objectives.logprobs.collate_sequences`), so the forward selects them with
`index_select`: no boolean mask, no `nonzero`, no device-to-host sync, and the shapes are known before the
forward. A forward pre-hook on the output head takes the hidden states, selects the N labelled rows, computes
their losses through `finetune.chunked_loss` (never the whole (N, V) logits) and hands the head zero rows:
the loss is computed inside the model's forward, where DDP, FSDP and DeepSpeed have the head's weight at hand.
A model that caps its logits after the head (Gemma 2) has the cap applied to each chunk (`final_logit_softcap`).
The attention mask comes from the collator's document ids (`finetune.training.model_inputs`).

Example:
    losses = target_losses(model, batch)            # (N,) float32, differentiable
    loss_sum = losses.sum()
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from finetune.chunked_loss import token_losses
from finetune.scoring import output_head, transformers_model
from finetune.training.model_inputs import model_inputs


def target_losses(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) float32 −log π(target_ids) at `batch["target_index"]`, in that order (KV cache off: see packing)."""
    return target_losses_and_aux(model, batch)[0]


def target_losses_and_aux(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`target_losses`, and the load-balancing loss a mixture of experts returns (`aux_loss`, when its config
    sets `output_router_logits`; None for other models).

    Under a whole-model `torch.compile` (a hook inside the compiled graph would break it) or without a
    transformers model inside, the model computes all logits and the N rows are taken from them.
    """
    inputs = model_inputs(model, batch)
    index, targets = batch["target_index"], batch["target_ids"]
    head = output_head(model)
    if head is None or hasattr(model, "_orig_mod") or _sharded(head):
        outputs = model(**inputs, use_cache=False)
        logits = outputs.logits  # (R, T, V)
        selected = logits.reshape(-1, logits.size(-1)).index_select(0, index)
        return F.cross_entropy(selected.float(), targets, reduction="none"), getattr(outputs, "aux_loss", None)
    found: list[torch.Tensor] = []
    softcap = final_logit_softcap(model)

    def losses_in_head(module: torch.nn.Module, args: tuple) -> tuple | None:
        if found:  # the loss calling the head on a chunk: let it through
            return None
        hidden = args[0]  # (R, T, H)
        selected = hidden.reshape(-1, hidden.size(-1)).index_select(0, index)  # (N, H)
        found.append(selected)  # marks the call as taken while the chunks go through the head
        found[0] = token_losses(module, selected, targets, softcap=softcap)
        return (selected[:0], *args[1:])  # the head itself runs on no rows

    handle = head.register_forward_pre_hook(losses_in_head)
    try:
        outputs = model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return found[0], getattr(outputs, "aux_loss", None)


def final_logit_softcap(model: Any) -> float | None:
    """The cap a model puts on its output logits after the head (Gemma 2's `final_logit_softcapping`), which a loss
    taken inside the head's hook must apply itself: without it, training, evaluation and the preference objectives'
    log-probabilities were those of uncapped logits, while the model (and `generate`) uses capped ones."""
    inner = transformers_model(model)
    cap = getattr(inner.config.get_text_config(), "final_logit_softcapping", None) if inner is not None else None
    return float(cap) if cap else None


def _sharded(head: torch.nn.Module) -> bool:
    """Whether the head's weight is sharded: FSDP2's `DTensor` (the loss inside its forward hook crashed the
    backward, SIGSEGV on 2 CPU ranks, torch 2.13) or a ZeRO-3 partition (`ds_id`: its backward hooks found no
    active submodule, the head's own output being unused). The whole logits are computed there instead."""
    weight = getattr(head, "weight", None)
    return isinstance(weight, DTensor) or hasattr(weight, "ds_id")
