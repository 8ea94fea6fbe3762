"""DPO (Rafailov et al. 2023) and two of its variants, on pairs (x, y_w chosen, y_l rejected).

With log π(y|x) summed over the completion's labelled tokens and π_ref the reference policy
(`finetune.training.objectives.reference`), the implicit reward is r(y) = β · log(π(y|x) / π_ref(y|x)),
Δ = log(π(y_w)/π_ref(y_w)) − log(π(y_l)/π_ref(y_l)) and, per pair:

- `sigmoid` (the paper's):  ℓ = −log σ(β · Δ)
- `hinge` (SLiC):           ℓ = max(0, 1 − β · Δ)
- `ipo` (Azar et al. 2023): ℓ = (Δ' − 1/(2β))², with Δ' the same log-ratios each divided by its
  completion's token count, as trl normalises IPO (its authors' form: β comparable across lengths)

These equal trl's DPOTrainer `loss_type` of the same name (`tests/test_preference.py` checks loss and
gradients). The step's loss is Σ ℓ / (pairs in the step, all processes), plus, with `train.rpo_alpha` α > 0,
α · Σ_{chosen tokens} −log π / (chosen completion tokens in the step): RPO's NLL term as trl computes it
(`loss_type=["sigmoid", "sft"]`, a mean over the tokens); the RPO paper divides each pair's NLL by its own
prompt + completion length instead, which weights short pairs more.

Example:
    objective = DPO(options, beta=0.1, loss_type="sigmoid", precomputed=False)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.training.objectives.base import CollateOptions, Models, Terms
from finetune.training.objectives.logprobs import sequence_logps
from finetune.training.objectives.pairs import (
    PairObjective,
    by_side,
    pair_metrics,
)
from finetune.training.objectives.reference import MeasuredAgainstStart


def dpo_losses(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    beta: float,
    loss_type: str,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
) -> torch.Tensor:
    """(P,) per-pair losses from the log-ratios log(π/π_ref) of each side (see the module docstring)."""
    if loss_type == "ipo":
        margin = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
        return (margin - 1 / (2 * beta)) ** 2
    margin = chosen_logratios - rejected_logratios
    if loss_type == "hinge":
        return torch.relu(1 - beta * margin)
    return -F.logsigmoid(beta * margin)


class DPO(PairObjective, MeasuredAgainstStart):
    name: str = "dpo"

    def __init__(
        self, options: CollateOptions, *, beta: float, loss_type: str, precomputed: bool, rpo_alpha: float = 0.0
    ):
        self.options, self.beta, self.loss_type, self.precomputed = options, beta, loss_type, precomputed
        self.rpo_alpha = rpo_alpha
        self.loss_units: tuple[str, ...] = ("pairs", "chosen_tokens") if rpo_alpha > 0 else ("pairs",)

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], *, reduce: bool) -> list[dict]:
        """The reference log-probabilities of every sequence of the step: precomputed, or scored now (the
        adapter disabled, or the starting weights swapped in)."""
        if self.precomputed:
            return [{"reference": batch["reference_logps"]} for batch in batches]
        return [{"reference": self.reference_logps(models, batch)} for batch in batches]

    def terms(self, models: Models, batch: dict[str, torch.Tensor], prepared: dict) -> Terms:
        logps = sequence_logps(models.step, batch)  # (2P,)
        chosen_ratios, rejected_ratios = by_side(logps - prepared["reference"].to(logps.dtype))
        chosen_tokens, rejected_tokens = by_side(batch["sequence_tokens"])
        losses = dpo_losses(chosen_ratios, rejected_ratios, self.beta, self.loss_type, chosen_tokens, rejected_tokens)
        metrics = pair_metrics(self.beta * chosen_ratios, self.beta * rejected_ratios, logps)
        sums = {"pairs": losses.sum()}
        if self.rpo_alpha > 0:
            sums["chosen_tokens"] = -self.rpo_alpha * by_side(logps)[0].sum()
        return Terms(sums, metrics)
