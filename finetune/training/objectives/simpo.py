"""SimPO (Meng et al. 2024): length-normalised log-probabilities as the reward, a target margin γ, no
reference policy; with `train.cpo_alpha` > 0, CPO-SimPO (an NLL term on the chosen completions).

With r(y) = β · (1/|y|) Σ_t log π(y_t | x, y_<t), per pair (x, y_w, y_l):

    ℓ_SimPO = −log σ(r(y_w) − r(y_l) − γ)

and the step's loss is Σ ℓ_SimPO / (pairs in the step) + α · Σ_{chosen tokens} −log π / (chosen tokens
in the step), both counted over every process. The NLL term is trl's CPOTrainer's (`cpo_alpha`: the mean
over the chosen completions' tokens of the batch, prompt excluded), which is where CPO-SimPO lives; with
α = 0 this is SimPO alone. Equal to trl's CPOTrainer with `loss_type="simpo"` (tested).

Example:
    objective = SimPO(options, beta=2.5, gamma=1.375, cpo_alpha=0.0)
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


class SimPO(PairObjective):
    name: str = "simpo"

    def __init__(self, options: CollateOptions, *, beta: float, gamma: float, cpo_alpha: float):
        self.options, self.beta, self.gamma, self.cpo_alpha = options, beta, gamma, cpo_alpha
        self.loss_units: tuple[str, ...] = ("pairs", "chosen_tokens") if cpo_alpha > 0 else ("pairs",)

    def terms(self, models: Models, batch: dict[str, torch.Tensor], prepared: dict) -> Terms:
        logps = sequence_logps(models.step, batch)  # (2P,)
        chosen_rewards, rejected_rewards = by_side(self.beta * logps / batch["sequence_tokens"].clamp(min=1))
        losses = -F.logsigmoid(chosen_rewards - rejected_rewards - self.gamma)
        sums = {"pairs": losses.sum()}
        if self.cpo_alpha > 0:
            sums["chosen_tokens"] = -self.cpo_alpha * by_side(logps)[0].sum()
        return Terms(sums, pair_metrics(chosen_rewards, rejected_rewards, logps))
