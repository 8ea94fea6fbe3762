"""The next token of each row: greedy (argmax, as `generate(do_sample=False)`) or sampled with its own generator.

A sampled row draws from its own `torch.Generator`, seeded by the request's `seed` (else at random), so
a seeded request gives the same tokens whichever rows share its batch. Filters follow the usual order:
temperature, then top-k, then top-p (the smallest set of tokens whose probability reaches `top_p`).

Example:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1)]
    next_tokens(logits, params, [None, make_generator(params[1])])     # logits (2, V) -> [id, id]
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The row's random generator (None for greedy rows): seeded by `params.seed`, else at random."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed & (2**64 - 1))  # any integer a client sends: torch takes 64 bits


def next_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token id per row of `logits` (B, V)."""
    chosen = logits.argmax(dim=-1).tolist()  # greedy rows; ties go to the lowest id, as in transformers
    for row, (row_params, generator) in enumerate(zip(params, generators)):
        if not row_params.greedy:
            # On the host: a row's generator is a host one, so a seed gives one stream wherever the model runs.
            chosen[row] = _sample(logits[row].float().cpu(), row_params, generator)
    return chosen


def _sample(scores: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token of one row. Every temperature and top_p the API accepts gives a distribution: the scores are
    shifted so the best is 0 before dividing (a tiny temperature such as 1e-40 made the best score inf, and
    softmax NaN), and top_p always keeps the best token (a top_p such as 1e-300 is 0 as a float32, which
    dropped them all). Either was a 500 for the request and for every row sharing its forward."""
    scores = (scores - scores.max()) / params.temperature  # (V,): at most 0, so never +inf nor NaN
    if 0 < params.top_k < scores.numel():
        kth_best = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        sorted_probabilities = sorted_scores.softmax(dim=-1)
        mass_before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities
        drop = mass_before >= params.top_p  # the tokens before this one already reach top_p
        drop[0] = False  # the best token stays, whatever top_p rounds to
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probabilities = scores.softmax(dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
