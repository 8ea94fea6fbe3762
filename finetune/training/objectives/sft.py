"""Supervised fine-tuning: the next-token loss of every labelled token, normalised by label tokens.

    loss = Σ_{labelled t} −log π(y_t | y_<t) / N_label_tokens

N counts the label tokens of the whole optimizer step on every process, so a step is one big batch
however its documents fall into micro-batches (`finetune.training.loss`). Rows are the documents of
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
from finetune.training.loss import forward_loss
from finetune.training.objectives.base import CollateOptions, Models, Terms
from finetune.training.objectives.logprobs import add_targets
from finetune.training.target_loss import target_losses


class SFT:
    name: str = "sft"
    loss_units: tuple[str, ...] = ("label_tokens",)
    metric_units: Mapping[str, str] = {"nll": "label_tokens"}
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
            loss_sum = target_losses(models.step, batch).sum()
        else:  # a batch collated elsewhere (`BATCH_SFT`)
            loss_sum, _ = forward_loss(models.step, batch)
        return Terms({"label_tokens": loss_sum}, {"nll": loss_sum.detach()})


BATCH_SFT = SFT(CollateOptions(pad_token_id=None, packing=True))
"""SFT for callers that hand over batches already collated (the objective `accumulate_gradients` and
`evaluate` use when none is given); its own `collate` is not used."""
