"""Supervised fine-tuning: the next-token loss of every labelled token, normalised by label tokens.

    loss = Σ_{labelled t} −log π(y_t | y_<t) / N_label_tokens

N counts the label tokens of the whole optimizer step on every process, so a step is one big batch
however its documents fall into micro-batches (`finetune.scoring`). Rows are the documents of
`text`, `instruction` and `chat` data, packed per micro-batch (`finetune.data.collate`).

Example:
    objective = SFT(CollateOptions(pad_token_id=0, packing=True))
    terms = objective.terms(models, objective.collate(rows), {})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from finetune.data.collate import collate_batch
from finetune.data.labels import IGNORE_INDEX
from finetune.scoring import forward_loss_terms, router_aux_coef
from finetune.training.objectives.base import CollateOptions, Models, Terms
from finetune.training.objectives.logprobs import add_targets
from finetune.training.target_loss import target_losses_and_aux


class SFT:
    name: str = "sft"
    loss_units: tuple[str, ...] = ("label_tokens",)
    metric_units: Mapping[str, str] = {"nll": "label_tokens", "router_aux": "label_tokens"}
    """`router_aux`: a mixture of experts' load-balancing loss, mean per label token (absent for other models)."""
    count_units: tuple[str, ...] = ("label_tokens",)

    def __init__(self, options: CollateOptions):
        self.options = options

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        options = self.options
        batch = collate_batch(rows, options.pad_token_id, options.packing, options.layout, document_index=True)
        return add_targets(batch)  # positions and documents found on the host: the step never syncs

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return {"label_tokens": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())}

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], *, reduce: bool) -> list[dict]:
        return [{} for _ in batches]

    def terms(self, models: Models, batch: dict[str, torch.Tensor], prepared: dict) -> Terms:
        if "target_index" in batch:  # collated here: positions found on the host, logits in chunks
            losses, aux = target_losses_and_aux(models.step, batch)
            loss_sum, router_aux = losses.sum(), None if aux is None else aux.float() * losses.shape[0]
        else:  # a batch collated elsewhere (`BATCH_SFT`)
            loss_sum, _, router_aux = forward_loss_terms(models.step, batch)
        if router_aux is None:
            return Terms({"label_tokens": loss_sum}, {"nll": loss_sum.detach()})
        # A mixture of experts' load-balancing loss, as transformers adds it: coefficient x aux per label token.
        loss = loss_sum + router_aux_coef(models.step) * router_aux
        return Terms({"label_tokens": loss}, {"nll": loss_sum.detach(), "router_aux": router_aux.detach()})


BATCH_SFT = SFT(CollateOptions(pad_token_id=None, packing=True))
"""SFT for callers that hand over batches already collated (the objective `accumulate_gradients` and
`evaluate` use when none is given); its own `collate` is not used."""
