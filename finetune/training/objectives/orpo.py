"""ORPO (Hong et al. 2024): the chosen completion's NLL plus an odds-ratio penalty; no reference policy.

With P̄(y|x) = exp((1/|y|) Σ_t log π(y_t | x, y_<t)) (the length-normalised likelihood) and
odds(y) = P̄ / (1 − P̄), per pair (x, y_w, y_l):

    ℓ = −(1/|y_w|) Σ_t log π(y_w,t | x, y_w,<t)  −  λ · log σ(log odds(y_w) − log odds(y_l))

with log odds(y) = log P̄ − log(1 − P̄) computed as mean log π − log1mexp(mean log π), stable near 0.
The step's loss is Σ ℓ / (pairs in the step, all processes), the paper's E over pairs (its Eq. 6).

Where trl differs: trl's ORPOTrainer takes the NLL term over the prompt and the completion (its own
comment: "computed over the full prompt and response") and averages it over all tokens of the batch,
not per pair. This follows the paper (Eqs. 2 and 6): the NLL of the chosen response given the prompt,
normalised per response. The odds-ratio term equals trl's (`odds_ratio_loss`, tested). Rewards for the
metrics are trl's: r = λ · mean log π(y|x).

Example:
    objective = ORPO(options, orpo_lambda=0.1)
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


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0: log1p(−exp x) below −log 2, log(−expm1 x) above (Mächler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_losses(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, orpo_lambda: float) -> torch.Tensor:
    """(P,) per-pair ORPO losses from each side's mean token log-probability."""
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    return -chosen_mean - orpo_lambda * F.logsigmoid(log_odds)


class ORPO(PairObjective):
    name: str = "orpo"
    loss_units: tuple[str, ...] = ("pairs",)

    def __init__(self, options: CollateOptions, *, orpo_lambda: float):
        self.options, self.orpo_lambda = options, orpo_lambda

    def terms(self, models: Models, batch: dict[str, torch.Tensor], prepared: dict) -> Terms:
        logps = sequence_logps(models.step, batch)  # (2P,)
        means = logps / batch["sequence_tokens"].clamp(min=1)
        chosen_mean, rejected_mean = by_side(means)
        losses = orpo_losses(chosen_mean, rejected_mean, self.orpo_lambda)
        metrics = pair_metrics(self.orpo_lambda * chosen_mean, self.orpo_lambda * rejected_mean, logps)
        return Terms({"pairs": losses.sum()}, metrics)
