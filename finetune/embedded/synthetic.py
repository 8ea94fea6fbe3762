"""Synthetic pretraining rows that can only be predicted by copying from earlier in the same row.

A small model pretrained on a little natural text does not learn to copy from its context (induction):
on the quickstart's bulletins it then writes fluent house style with the wrong town and figures, however
it is fine-tuned. These rows make copying the only way to lower the loss:

- `repeat`: random token segments (4 to 47 tokens), each followed at once by itself again. The loss is on
  the repeats only (after their first token), so a model gains only by finding where it is in the
  earlier copy and reading on (an induction head).
- `recall`: blocks of `key: value` lines (random 1-2 token keys, 1-3 token values), then the same lines
  again in a shuffled order. The loss is on the repeated values and their line ends: given a key seen
  earlier, look up what followed it.

Tokens are drawn uniformly from the ordinary (non-special) vocabulary, so nothing here can be memorised:
the only regularity is the repetition within a row. Pure Python, seeded: the same arguments give the
same rows.

Example:
    ids, labels = synthetic_rows(tokenizer, num_rows=64, seq_len=256, seed=0)   # (64, 256) each
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedTokenizerFast

IGNORE_INDEX = -100


def _repeat_row(rng: random.Random, ordinary: range, seq_len: int) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < seq_len:
        segment = [rng.choice(ordinary) for _ in range(rng.randint(4, 47))]
        ids += segment + segment
        labels += [IGNORE_INDEX] * (len(segment) + 1) + segment[1:]
    return ids, labels


def _recall_row(
    rng: random.Random, ordinary: range, seq_len: int, colon: int, newline: int
) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    labels: list[int] = []
    while len(ids) < seq_len:
        num_keys = rng.randint(2, 8)
        keys = [[rng.choice(ordinary) for _ in range(rng.randint(1, 2))] for _ in range(num_keys)]
        values = [[rng.choice(ordinary) for _ in range(rng.randint(1, 3))] for _ in range(num_keys)]
        for key, value in zip(keys, values):
            ids += [*key, colon, *value, newline]
            labels += [IGNORE_INDEX] * (len(key) + len(value) + 2)
        ids.append(newline)
        labels.append(IGNORE_INDEX)
        for index in rng.sample(range(num_keys), num_keys):
            key, value = keys[index], values[index]
            ids += [*key, colon, *value, newline]
            labels += [IGNORE_INDEX] * (len(key) + 1) + [*value, newline]
        ids.append(newline)
        labels.append(IGNORE_INDEX)
    return ids, labels


def synthetic_rows(
    tokenizer: PreTrainedTokenizerFast, num_rows: int, seq_len: int, seed: int, recall: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, labels)`, each `(num_rows, seq_len)`: alternately `repeat` and `recall` rows (`repeat` rows
    only if not `recall`), each starting with BOS.

    Labels are `IGNORE_INDEX` wherever the next token cannot be known from the row so far.
    """
    rng = random.Random(seed)
    num_special = len(tokenizer.all_special_ids)
    assert sorted(tokenizer.all_special_ids) == list(range(num_special)), "special tokens come first"
    ordinary = range(num_special, len(tokenizer))
    colon, newline = tokenizer.convert_tokens_to_ids(":"), tokenizer.convert_tokens_to_ids("Ċ")  # byte-level "\n"
    assert isinstance(colon, int) and isinstance(newline, int)
    ids = torch.empty((num_rows, seq_len), dtype=torch.long)
    labels = torch.empty((num_rows, seq_len), dtype=torch.long)
    for row in range(num_rows):
        if row % 2 == 0 or not recall:
            row_ids, row_labels = _repeat_row(rng, ordinary, seq_len - 1)
        else:
            row_ids, row_labels = _recall_row(rng, ordinary, seq_len - 1, colon, newline)
        ids[row] = torch.tensor([tokenizer.bos_token_id, *row_ids[: seq_len - 1]])
        labels[row] = torch.tensor([IGNORE_INDEX, *row_labels[: seq_len - 1]])
    return ids, labels


def copy_score(model, tokenizer: PreTrainedTokenizerFast, num_sequences: int = 64, length: int = 32) -> float:
    """In-context copying: accuracy of greedy next-token predictions over a random token sequence seen before.

    Each probe is `BOS s s` for a random sequence `s` of `length` ordinary tokens; the score is the share
    of the second `s`'s tokens (all but its first, which nothing announces) that the model predicts
    exactly. Chance is 1 / vocabulary size; a model that has learnt induction scores near 1.
    """
    generator = torch.Generator().manual_seed(1234)  # fixed probes: scores are comparable between models
    num_special = len(tokenizer.all_special_ids)
    sequences = torch.randint(num_special, len(tokenizer), (num_sequences, length), generator=generator)
    bos = torch.full((num_sequences, 1), tokenizer.bos_token_id)
    input_ids = torch.cat([bos, sequences, sequences], dim=1)  # (N, 1 + 2L)
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits  # (N, 1 + 2L, V)
    predicted = logits[:, length + 1 : 2 * length].argmax(-1)  # predictions of the second s's tokens 1..L-1
    return (predicted == sequences[:, 1:]).float().mean().item()
