"""Pairs: what DPO, ORPO and SimPO share: one forward over both completions, and the pair metrics.

A micro-batch of P pairs is 2P sequences, chosen and rejected alternating (sequence 2i is pair i's
chosen completion, 2i+1 its rejected one), packed padding-free into as few rows as fit with each sequence
isolated (`finetune.training.objectives.logprobs`): one forward pass, never a second one for the
rejected side, and no padding (trl turns padding-free off for DPO). Pair objectives normalise by pairs:
Σ per-pair losses / (pairs in the step, all processes).

Metrics (sums here; means over the step's pairs in the log): `rewards_chosen`, `rewards_rejected` (each
objective's implicit reward r), `reward_margin` (r_chosen − r_rejected), `reward_accuracy` (share with
r_chosen > r_rejected, strictly, as trl counts it), `logps_chosen`, `logps_rejected` (Σ log π of the
completion), and `nll`, the chosen completions' NLL per token (its exp is the evaluation's `eval_ppl`).

Example:
    batch = collate_pairs(rows, options)              # 2P sequences
    chosen, rejected = by_side(sequence_logps(model, batch))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from finetune.training.objectives.base import CollateOptions, Models
from finetune.training.objectives.logprobs import collate_sequences
from finetune.training.objectives.reference import REFERENCE_COLUMNS

PAIR_METRIC_UNITS = {
    "rewards_chosen": "pairs",
    "rewards_rejected": "pairs",
    "reward_margin": "pairs",
    "reward_accuracy": "pairs",
    "logps_chosen": "pairs",
    "logps_rejected": "pairs",
    "nll": "chosen_tokens",
}
PAIR_COUNT_UNITS = ("pairs", "chosen_tokens")


def collate_pairs(rows: list[dict[str, Any]], options: CollateOptions) -> dict[str, torch.Tensor]:
    """2P sequences (chosen, rejected alternating) in one micro-batch; with precomputed reference columns in
    the rows, also `reference_logps` (2P,) in the same order."""
    sequences = []
    for row in rows:
        sequences.append({"input_ids": row["chosen_input_ids"], "labels": row["chosen_labels"]})
        sequences.append({"input_ids": row["rejected_input_ids"], "labels": row["rejected_labels"]})
    batch = collate_sequences(sequences, options.pad_token_id, options.packing, options.layout)
    if REFERENCE_COLUMNS[0] in rows[0]:
        batch["reference_logps"] = torch.tensor([row[c] for row in rows for c in REFERENCE_COLUMNS])
    return batch


def pair_counts(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    tokens = batch["sequence_tokens"]
    return {"pairs": tokens.shape[0] // 2, "chosen_tokens": int(tokens[0::2].sum())}


def by_side(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2P,) in sequence order -> (chosen (P,), rejected (P,))."""
    return values[0::2], values[1::2]


def pair_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, logps: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Metric sums over the micro-batch's pairs (detached; see the module docstring)."""
    chosen_rewards, rejected_rewards, logps = chosen_rewards.detach(), rejected_rewards.detach(), logps.detach()
    chosen_logps, rejected_logps = by_side(logps)
    margins = chosen_rewards - rejected_rewards
    return {
        "rewards_chosen": chosen_rewards.sum(),
        "rewards_rejected": rejected_rewards.sum(),
        "reward_margin": margins.sum(),
        "reward_accuracy": (margins > 0).sum().to(margins.dtype),
        "logps_chosen": chosen_logps.sum(),
        "logps_rejected": rejected_logps.sum(),
        "nll": -chosen_logps.sum(),
    }


class PairObjective:
    """The part every objective on pairs shares: collation, counts and metric units; no step preparation
    (no reference policy: ORPO, SimPO). DPO, which has a reference, prepares its own."""

    metric_units: Mapping[str, str] = PAIR_METRIC_UNITS
    count_units: tuple[str, ...] = PAIR_COUNT_UNITS
    options: CollateOptions

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_pairs(rows, self.options)

    def counts(self, batch: dict[str, torch.Tensor]) -> dict[str, int]:
        return pair_counts(batch)

    def prepare(self, models: Models, batches: list[dict[str, torch.Tensor]], *, reduce: bool) -> list[dict]:
        return [{} for _ in batches]
