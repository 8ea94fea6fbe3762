"""GRPO's clipped policy-gradient loss on flat per-token tensors, averaged as trl 1.16's `loss_type` says.

For completion token t of completion i, with π the policy now, π_old the policy that sampled it (π itself,
detached, when each generation is trained on once), A_i the completion's advantage and m_t its loss mask
(0 after the completion's end, or for a truncated completion under `mask_truncated_completions`):

    r_t = exp(log π(t) − log π_old(t))
    ℓ_t = −min(r_t · A_i, clip(r_t, 1 − ε, 1 + ε_high) · A_i) + β · r_t · KL_t
    KL_t = exp(log π_ref(t) − log π(t)) − (log π_ref(t) − log π(t)) − 1       (k3, only with β > 0)

The KL term is weighted by the importance ratio r_t (trl 1.16's default `use_bias_correction_kl`, after
DeepSeek-V3.2): its gradient is then the unbiased reverse-KL gradient, even on-policy where r_t = 1.

and the step's loss averages ℓ_t · m_t as trl does:
- `grpo`: per completion over its tokens, then over the completions of each micro-batch, then over
  micro-batches (every micro-batch of a full step holds the same number of completions: the mean over
  completions);
- `bnpo`: over the tokens of each micro-batch, then over micro-batches;
- `dr_grpo`: Σ over tokens / (completions × max_completion_length);
- `dapo`: Σ over tokens / (completion tokens of the whole step, on every process).

A run set by epochs may end with a micro-batch of fewer prompts, which trl never meets (its sampler drops an
incomplete batch); there `grpo` and `bnpo` weight each micro-batch by its completions.

The loop normalises by one unit, the step's completions on every process (C); each function here returns
the micro-batch's share of the sum Σ that gives trl's loss as Σ / C (e.g. `dapo`: Σ ℓ·m · C / tokens).

Example:
    loss_sum, parts = policy_loss_sum(logps, old, None, advantages, mask, owner, settings, LossScale(...))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossSettings:
    loss_type: str
    epsilon: float
    epsilon_high: float
    beta: float
    max_completion_length: int


@dataclass(frozen=True)
class LossScale:
    """What the averaging needs beyond the micro-batch: its completions, and the step's (all processes)."""

    completions: int
    """S: completions in this micro-batch."""
    step_completions: torch.Tensor
    """C: completions of the whole step on every process (0-dim)."""
    step_tokens: torch.Tensor
    """Completion tokens in the loss (mask 1) over the whole step on every process (0-dim)."""


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    settings: LossSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ℓ_t (N,) and per-token parts for metrics (`clipped` 0/1, `kl` the term β weighs: r_t · KL_t, which trl
    logs), all (N,)."""
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    low = (ratio < 1 - settings.epsilon) & (advantages < 0)
    high = (ratio > 1 + settings.epsilon_high) & (advantages > 0)
    parts = {"clipped": (low | high).float()}
    if settings.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probabilities"
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + settings.beta * kl * ratio
        parts["kl"] = (kl * ratio).detach()  # as trl logs it: E_old[r·k3] estimates the policy's KL now
    return loss, parts


def per_sequence_sums(values: torch.Tensor, owner: torch.Tensor, sequences: int) -> torch.Tensor:
    """(S,) Σ of `values` (N,) over each sequence's tokens (`owner` (N,) in 0..S-1)."""
    return values.new_zeros(sequences).index_add(0, owner, values)


def loss_sum(
    token_loss: torch.Tensor, mask: torch.Tensor, owner: torch.Tensor, settings: LossSettings, scale: LossScale
) -> torch.Tensor:
    """This micro-batch's share of Σ (see the module docstring): the step's loss is Σ / C."""
    masked = token_loss * mask
    kind = settings.loss_type
    if kind == "grpo":
        tokens = per_sequence_sums(mask, owner, scale.completions).clamp(min=1.0)
        return (per_sequence_sums(masked, owner, scale.completions) / tokens).sum()
    if kind == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) * scale.completions
    if kind == "dr_grpo":
        return masked.sum() / settings.max_completion_length
    if kind == "dapo":
        return masked.sum() * scale.step_completions / scale.step_tokens.clamp(min=1.0)
    raise AssertionError(f"unknown loss_type {kind}")
