"""Batched sampling with a KV cache from a model as it is now: every row of a batch decoded together.

All prompts (GRPO: every prompt of a step, each repeated `num_generations` times) are prefilled in one
left-padded forward (`KVBatch`), then one token per row per forward. A row that has written a stop token
(or reached `max_new_tokens`) leaves the batch (`KVBatch.select`), so late steps run on the rows still
writing. Filters are applied as transformers' `generate` applies them: temperature, then top-k, then top-p
(the smallest set of tokens whose probability reaches `top_p`). Draws use the process's global torch RNG
on the model's device, so a checkpoint that holds the RNG state resumes the same samples.

The model runs in eval mode (no dropout: the samples come from the policy the loss scores) under
`torch.no_grad`; its training mode is restored after. No copy of the weights is made: a LoRA model
generates with its adapter as it stands.

Example:
    settings = SampleSettings(max_new_tokens=32, temperature=1.0)
    completions = sample_completions(model, [[1, 5, 6], [1, 7]], settings, stop_ids={2}, pad_token_id=0)
    completions[0]     # [token, ..., 2]: up to and including the first stop token
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from finetune.generation.kvbatch import KVBatch


@dataclass(frozen=True)
class SampleSettings:
    """How tokens are drawn. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def filtered_scores(logits: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
    """(B, V) logits -> scores after temperature, top-k and top-p (filtered-out tokens at -inf)."""
    scores = logits.float() / settings.temperature
    if 0 < settings.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, settings.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if settings.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probabilities = sorted_scores.softmax(dim=-1)
        mass_before = probabilities.cumsum(dim=-1) - probabilities
        drop = mass_before >= settings.top_p  # the tokens before this one already reach top_p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores


def draw(logits: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
    """One token id per row of `logits` (B, V), as a (B,) tensor on the logits' device."""
    if settings.temperature == 0.0:
        return logits.argmax(dim=-1)
    probabilities = filtered_scores(logits, settings).softmax(dim=-1)
    return torch.multinomial(probabilities, 1).squeeze(-1)


def sample_completions(
    model: Any,
    prompts: list[list[int]],
    settings: SampleSettings,
    *,
    stop_ids: set[int] | frozenset[int],
    pad_token_id: int,
) -> list[list[int]]:
    """The completion of each prompt: its sampled tokens, up to and including the first stop token, at most
    `settings.max_new_tokens`."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _decode(model, prompts, settings, stop_ids, pad_token_id, device)
    finally:
        model.train(was_training)


def _decode(model, prompts, settings, stop_ids, pad_token_id, device) -> list[list[int]]:
    batch = KVBatch.from_prompts(prompts, ["policy"] * len(prompts), pad_token_id, device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    completions: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # which prompt each batch row decodes
    tokens = batch.input_ids
    for step in range(settings.max_new_tokens):
        output = model(input_ids=tokens, logits_to_keep=1, **batch.forward_kwargs())
        batch.advance()
        chosen = draw(output.logits[:, -1], settings)  # (B_t,)
        finished = torch.isin(chosen, stops)
        chosen_list, finished_list = chosen.tolist(), finished.tolist()
        for row, token in zip(rows, chosen_list):
            completions[row].append(token)
        if step + 1 == settings.max_new_tokens:
            break
        if any(finished_list):
            keep = [index for index, done in enumerate(finished_list) if not done]
            if not keep:
                break
            batch.select(keep)
            rows = [rows[index] for index in keep]
            chosen = chosen[keep]
        tokens = chosen[:, None]
    return completions
