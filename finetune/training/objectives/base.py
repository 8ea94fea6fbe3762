"""The objective interface: a micro-batch in, loss sums per normalisation unit and metric sums out.

An objective owns its data shape (which rows it reads), its collation, and its loss. The loop asks it,
per optimizer step of G micro-batches on P processes:

1. `counts(batch)` for each micro-batch, on the host: how many of each unit it holds (`label_tokens`
   for SFT, `pairs` for the paired objectives, `examples` for KTO). Summed over the step and the
   processes (one all-reduce, kept on the device): N_u.
2. `prepare(models, batches)` once: the no-grad work of the whole step (reference log-probabilities,
   KTO's KL baseline, which must be known before the first backward). An online objective (generate,
   score) would do its generation here, without touching the loop.
3. `terms(models, batch, prepared)` per micro-batch: Σ of the loss over each unit's members, and metric
   sums. The loop backpropagates Σ_u sum_u · P / N_u (DDP averages gradients over processes, hence · P):
   the gradient of Σ_u mean_u over the whole step, however it is split into micro-batches and processes.
   An objective whose step trains on tokens the host cannot count before it (GRPO's sampled completions)
   says how many with `trained_tokens(prepared)`, a tensor on the device, for `tokens_seen`.
4. `summarise`: one more all-reduce of every sum, then loss = Σ_u sum_u / N_u and each metric's mean over
   its unit (`metric_units`); `ppl` = exp(mean `nll`) where the objective reports an NLL.

Example:
    counts = objective.counts(batch)                  # {"pairs": tensor(8)}
    terms = objective.terms(models, batch, objective.prepare(models, [batch])[0])
    terms.losses["pairs"].backward()
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from finetune.data.collate import Layout
from finetune.scoring import perplexity_of


@dataclass(frozen=True)
class Models:
    """The trained model, as each kind of pass needs it."""

    step: Any
    """The model that takes gradients (DDP-wrapped, sharded or compiled: `TrainingRun.model_for_step`)."""
    peft: Any
    """The same LoRA model unwrapped, for no-grad passes (the reference with the adapter disabled)."""
    accelerator: Any


@dataclass(frozen=True)
class CollateOptions:
    """How rows become tensors: the recipe's packing and layout, the tokenizer's padding, the length limit."""

    pad_token_id: int | None
    packing: bool
    layout: Layout = "rows"
    max_seq_len: int = 512


@dataclass
class Terms:
    """One micro-batch's contribution: loss sums per unit (with gradient) and metric sums (detached)."""

    losses: dict[str, torch.Tensor]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """What the loop, evaluation and reference precomputation ask of an objective (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def loss_units(self) -> tuple[str, ...]:
        """The units the loss is normalised by: `terms` returns a loss sum over each."""

    @property
    def metric_units(self) -> Mapping[str, str]:
        """Each metric's unit: its sum is divided by that unit's count over the step (or the evaluation)."""

    @property
    def count_units(self) -> tuple[str, ...]:
        """Every unit `counts` reports (the loss units and the metrics' units), in a fixed order."""

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]: ...

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]: ...

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], *, reduce: bool) -> list[dict]: ...

    def terms(self, models: Models, batch: dict[str, torch.Tensor], prepared: dict) -> Terms: ...


@runtime_checkable
class CarriesState(Protocol):
    """An objective whose next steps train on what an earlier step computed (GRPO's completions, rewards and
    π_old through a `num_iterations` group): a checkpoint keeps it, so a resumed run trains on it again."""

    def carried_state(self) -> list[dict] | None:
        """What the next step will use again, or None when it computes everything afresh."""
        ...

    def restore_carried_state(self, states: list[dict], device: torch.device) -> None:
        """Take back what `carried_state` returned (read from a checkpoint, its tensors on the host)."""
        ...


def summarise(objective: Objective, sums: Mapping[str, float], counts: Mapping[str, float]) -> dict[str, float]:
    """The loss and each metric's mean, from sums and counts over a step or an evaluation.

    `sums` holds `loss/<unit>` for each loss unit and each metric's name; `counts` each unit's count.
    """
    loss = sum(sums[f"loss/{unit}"] / max(counts[unit], 1) for unit in objective.loss_units)
    result = {"loss": loss}
    for name, unit in objective.metric_units.items():
        if counts[unit] > 0 and name in sums:  # a metric some models do not report (router_aux) is left out
            result[name] = sums[name] / counts[unit]
    if "nll" in result:
        result["ppl"] = perplexity_of(result.pop("nll"))
    if "reward_margin" not in objective.metric_units and {"rewards_chosen", "rewards_rejected"} <= result.keys():
        result["reward_margin"] = result["rewards_chosen"] - result["rewards_rejected"]  # unpaired: of the means
    finish = getattr(objective, "finish_summary", None)
    if finish is not None:  # statistics that are not means (a standard deviation), from means of sums
        finish(result, counts)
    return result


def describe_rewards(metrics: Mapping[str, float], prefix: str = "") -> str:
    """`, reward accuracy 93.8%, margin 1.204` for the metrics that are there (empty for SFT); `prefix`
    `eval_` reads an evaluation's. An online objective's reward, and how its step's time split between
    generation, the reward functions and the update (`step_s` less the two)."""
    parts = []
    if f"{prefix}reward" in metrics:
        parts.append(f"reward {metrics[prefix + 'reward']:.3f}")
    if {"generate_s", "reward_s", "step_s"} <= metrics.keys():
        generate, reward = metrics["generate_s"], metrics["reward_s"]
        update = metrics["step_s"] - generate - reward
        parts.append(
            f"step {metrics['step_s']:.2f} s = generation {generate:.2f} + rewards {reward:.2f} + update {update:.2f}"
        )
    if f"{prefix}reward_accuracy" in metrics:
        parts.append(f"reward accuracy {metrics[prefix + 'reward_accuracy']:.1%}")
    if f"{prefix}reward_margin" in metrics:
        parts.append(f"margin {metrics[prefix + 'reward_margin']:.3f}")
    return "".join(f", {part}" for part in parts)
