"""Training objectives, beside each other: SFT, DPO, ORPO, SimPO and KTO, each with its data shape, its
collation and its loss, behind one small interface (`base.Objective`) the loop calls without knowing which.

- `sft`: next-token loss per label token (text, instruction, chat rows).
- `dpo`, `orpo`, `simpo`: pairs (`preference` rows), both completions in one packed forward (`pairs`).
- `kto`: unpaired examples (`unpaired_preference` rows) against a KL baseline.
- `logprobs`: the shared code: sequences packed padding-free, log-probabilities summed per sequence.
- `reference`: the reference policy without a second model: the adapter disabled, or precomputed.

An online objective (GRPO: generate, score, update) fits the same interface: its `prepare` generates
and scores the step's completions, its `terms` is the policy-gradient loss; the loop does not change.

Example:
    objective = objective_for(recipe, tokenizer)
    batch = objective.collate([data.train[0], data.train[1]])
"""

from __future__ import annotations

from typing import Any

from finetune.data.chat_turns import chat_turn_closer_ids
from finetune.data.collate import Layout
from finetune.generation.sample import SampleSettings
from finetune.recipe import Recipe
from finetune.training.objectives.base import CollateOptions, Objective
from finetune.training.objectives.dpo import DPO
from finetune.training.objectives.grpo import GRPO, GRPOSettings
from finetune.training.objectives.grpo_loss import LossSettings
from finetune.training.objectives.kto import KTO
from finetune.training.objectives.orpo import ORPO
from finetune.training.objectives.sft import SFT
from finetune.training.objectives.simpo import SimPO
from finetune.training.rewards import load_reward_functions


def collate_options(recipe: Recipe, tokenizer: Any, varlen: bool = False) -> CollateOptions:
    """The recipe's packing and layout (flash_attention_2 wants one padding-free sequence; sdpa/eager are
    faster on (R, T) packed rows; under `varlen` attention rows of a few bucketed widths), the tokenizer's pad
    token and the length limit."""
    layout: Layout = "rows"
    if recipe.model.attn_implementation == "flash_attention_2":
        layout = "one_sequence"
    elif varlen:
        layout = "bucketed_rows"
    return CollateOptions(tokenizer.pad_token_id, recipe.data.packing, layout, recipe.data.max_seq_len)


def objective_for(recipe: Recipe, tokenizer: Any, varlen: bool = False) -> Objective:
    """The objective `train.objective` names, set up with its `train` settings; `varlen`: the model runs
    varlen attention (`finetune.training.varlen_attention`), whose rows come in bucketed widths."""
    options, train = collate_options(recipe, tokenizer, varlen), recipe.train
    if train.objective == "dpo":
        assert train.beta is not None and train.dpo_loss is not None and train.rpo_alpha is not None
        return DPO(options, beta=train.beta, loss_type=train.dpo_loss, precomputed=bool(train.precompute_reference),
                   rpo_alpha=train.rpo_alpha)  # fmt: skip
    if train.objective == "orpo":
        assert train.orpo_lambda is not None
        return ORPO(options, orpo_lambda=train.orpo_lambda)
    if train.objective == "simpo":
        assert train.beta is not None and train.simpo_gamma is not None and train.cpo_alpha is not None
        return SimPO(options, beta=train.beta, gamma=train.simpo_gamma, cpo_alpha=train.cpo_alpha)
    if train.objective == "kto":
        assert train.beta is not None and train.desirable_weight is not None and train.undesirable_weight is not None
        return KTO(options, beta=train.beta, desirable_weight=train.desirable_weight,
                   undesirable_weight=train.undesirable_weight)  # fmt: skip
    if train.objective == "grpo":
        rewards = load_reward_functions(train.reward_functions or [])
        return GRPO(
            options,
            grpo_settings(recipe),
            tokenizer,
            rewards,
            chat_turn_closer_ids(tokenizer, recipe.data.chat_template),
        )
    return SFT(options)


def grpo_settings(recipe: Recipe) -> GRPOSettings:
    """GRPO's settings from the recipe's `train` section (defaults filled in by the recipe)."""
    train = recipe.train
    assert train.num_generations is not None and train.max_completion_length is not None
    assert train.temperature is not None and train.top_p is not None and train.top_k is not None
    assert train.loss_type is not None and train.epsilon is not None and train.epsilon_high is not None
    assert train.num_iterations is not None and train.scale_rewards is not None and train.beta is not None
    functions = train.reward_functions or []
    return GRPOSettings(
        num_generations=train.num_generations,
        sample=SampleSettings(train.max_completion_length, train.temperature, train.top_p, train.top_k),
        loss=LossSettings(train.loss_type, train.epsilon, train.epsilon_high, train.beta, train.max_completion_length),
        num_iterations=train.num_iterations,
        scale_rewards=train.scale_rewards,
        mask_truncated_completions=bool(train.mask_truncated_completions),
        reward_weights=tuple(train.reward_weights or [1.0] * len(functions)),
        seed=train.seed,
    )
