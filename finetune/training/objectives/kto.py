"""KTO (Ethayarajh et al. 2024) on unpaired examples (x, y, desirable or not).

With the log-ratio ρ(x, y) = log(π(y|x) / π_ref(y|x)) (completion tokens summed) and a KL baseline z₀:

    desirable:    ℓ = w_D · (1 − σ(β · (ρ − z₀)))
    undesirable:  ℓ = w_U · (1 − σ(β · (z₀ − ρ)))

z₀ = max(0, mean over mismatched pairs of log(π(y'|x) / π_ref(y'|x))), without gradient: each example's
prompt x_i paired with the completion of the previous example of its micro-batch, y_{i−1} (rotating, as
the paper and trl build them: the same set of completions as the rewards, each under another prompt).
The mean is taken over every mismatched pair of the optimizer step on every process (the step's `prepare`
pass, one all-reduce), so z₀ is the step's; trl averages per micro-batch and process, which is the same
with one micro-batch per step. A micro-batch of one example (the last of an epoch whose size leaves one over,
or of an evaluation) has no other completion: its own pair would make z₀ its own log-ratio ρ, so that its
loss is 1 − σ(0) = 0.5 whatever it learnt. Its KL sequence is still scored (every process runs the same
passes) but counts for nothing, and a step with no mismatched pair at all takes z₀ = 0 (the clamp's floor).
The loss is Σ ℓ / (examples in the step, all processes), trl's mean.

Rewards for the metrics are β · ρ, averaged over the desirable (`rewards_chosen`) and the undesirable
(`rewards_rejected`) examples; `reward_margin` is the difference of those means, `kl` is z₀.

Example:
    objective = KTO(options, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from finetune.data.labels import IGNORE_INDEX
from finetune.training.objectives.base import CollateOptions, Models, Terms
from finetune.training.objectives.logprobs import collate_sequences, sequence_logps
from finetune.training.objectives.reference import MeasuredAgainstStart

KL_PREFIX = "kl/"


def mismatched(rows: list[dict[str, Any]], max_seq_len: int) -> list[dict[str, list[int]]]:
    """KL sequences: row i's prompt with row i−1's completion (cyclically), cut to `max_seq_len` tokens.

    A sequence's first label stays -100, as the rows' own do: after an empty prompt (no BOS) the completion's
    first token would be scored from the end of the sequence packed before it, and counted as that one's.
    """
    sequences = []
    for index, row in enumerate(rows):
        other = rows[index - 1]
        prompt, start = row["prompt_length"], other["prompt_length"]
        input_ids = row["input_ids"][:prompt] + other["input_ids"][start:]
        labels = [IGNORE_INDEX] * prompt + other["labels"][start:]
        if labels:
            labels[0] = IGNORE_INDEX
        sequences.append({"input_ids": input_ids[:max_seq_len], "labels": labels[:max_seq_len]})
    return sequences


def mismatched_pairs(examples: int) -> int:
    """How many of a micro-batch's KL sequences are mismatched: all of them, but none for a lone example, whose
    rotation pairs its prompt with its own completion."""
    return examples if examples > 1 else 0


class KTO(MeasuredAgainstStart):
    name: str = "kto"
    loss_units: tuple[str, ...] = ("examples",)
    metric_units: Mapping[str, str] = {
        "rewards_chosen": "desirable",
        "rewards_rejected": "undesirable",
        "logps_chosen": "desirable",
        "logps_rejected": "undesirable",
        "kl": "examples",
        "nll": "desirable_tokens",
    }
    count_units: tuple[str, ...] = ("examples", "desirable", "undesirable", "desirable_tokens")

    def __init__(self, options: CollateOptions, *, beta: float, desirable_weight: float, undesirable_weight: float):
        self.options, self.beta = options, beta
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The examples' sequences, their KL sequences (keys prefixed `kl/`: a layout of their own, scored
        without gradient), and `desirable` (n,)."""
        options = self.options
        sequences = [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]
        batch = collate_sequences(sequences, options.pad_token_id, options.packing, options.layout)
        kl = collate_sequences(mismatched(rows, options.max_seq_len), options.pad_token_id, options.packing,
                               options.layout)  # fmt: skip
        batch.update({f"{KL_PREFIX}{key}": value for key, value in kl.items()})
        batch["desirable"] = torch.tensor([bool(row["desirable"]) for row in rows])
        return batch

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        desirable = batch["desirable"]
        tokens = batch["sequence_tokens"]
        return {
            "examples": len(desirable),
            "desirable": int(desirable.sum()),
            "undesirable": int((~desirable).sum()),
            "desirable_tokens": int(tokens[desirable].sum()),
        }

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], *, reduce: bool) -> list[dict]:
        """Reference log-probabilities of the examples, and the step's KL baseline z₀ (an all-reduce with
        `reduce`; evaluation takes each batch's own)."""
        references, kl_sums, count = [], [], 0
        for batch in batches:
            kl_batch = {key.removeprefix(KL_PREFIX): value for key, value in batch.items() if key.startswith(KL_PREFIX)}
            references.append(self.reference_logps(models, batch))  # (n,)
            with torch.no_grad():
                kl_logratios = sequence_logps(models.peft, kl_batch) - self.reference_logps(models, kl_batch)
            pairs = mismatched_pairs(len(batch["desirable"]))
            kl_sums.append(kl_logratios.sum() if pairs else torch.zeros_like(kl_logratios.sum()))
            count += pairs
        device = kl_sums[0].device
        totals = torch.stack([torch.stack(kl_sums).sum(), torch.tensor(float(count), device=device)])
        if reduce:
            totals = models.accelerator.reduce(totals, reduction="sum")
        z0 = (totals[0] / totals[1].clamp(min=1)).clamp(min=0)  # no mismatched pair in the step: 0
        return [{"reference": reference, "z0": z0} for reference in references]

    def terms(self, models: Models, batch: dict[str, torch.Tensor], prepared: dict) -> Terms:
        desirable = batch["desirable"]
        logps = sequence_logps(models.step, batch)  # (n,)
        ratios = logps - prepared["reference"].to(logps.dtype)
        z0 = prepared["z0"].to(logps.dtype)
        losses = torch.where(
            desirable,
            self.desirable_weight * (1 - torch.sigmoid(self.beta * (ratios - z0))),
            self.undesirable_weight * (1 - torch.sigmoid(self.beta * (z0 - ratios))),
        )
        rewards, detached = self.beta * ratios.detach(), logps.detach()
        zero = torch.zeros_like(rewards)
        metrics = {
            "rewards_chosen": torch.where(desirable, rewards, zero).sum(),
            "rewards_rejected": torch.where(desirable, zero, rewards).sum(),
            "logps_chosen": torch.where(desirable, detached, zero).sum(),
            "logps_rejected": torch.where(desirable, zero, detached).sum(),
            "kl": z0.detach() * len(desirable),
            "nll": -torch.where(desirable, detached, zero).sum(),
        }
        return Terms({"examples": losses.sum()}, metrics)
