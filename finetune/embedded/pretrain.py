"""Brief full-parameter pretraining of the embedded base, so it is a language model rather than noise.

A plain, deterministic loop: documents become one token stream (BOS ... EOS per document) cut into rows
of `seq_len` tokens; a few rows are held out; the rest are visited in an order drawn from a seeded
generator; AdamW with linear warmup and cosine decay; the loss is the mean next-token cross-entropy.
Nothing here depends on the wall clock or on global RNG state, so the same inputs give the same weights.

Example:
    rows = token_rows(tokenizer, corpus.documents, seq_len=256)
    result = pretrain(model, rows, PretrainSettings(steps=300, micro_batch_size=16, lr=3e-3))
    result.final_loss, result.heldout_loss_after
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from finetune.embedded.settings import PretrainSettings


@dataclass(frozen=True)
class PretrainResult:
    """What the loop did, for the build record."""

    steps: int
    tokens_seen: int
    first_loss: float
    final_loss: float
    """Mean training loss over the last 10% of steps (at least one)."""
    heldout_loss_before: float
    heldout_loss_after: float
    seconds: float


def token_rows(tokenizer: PreTrainedTokenizerFast, documents: list[str], seq_len: int) -> torch.Tensor:
    """Concatenate `BOS doc EOS` for every document and cut the stream into `(num_rows, seq_len)` ids.

    The tail shorter than a row is dropped. Rows cross document boundaries, as in ordinary pretraining:
    EOS followed by BOS teaches where a document ends.
    """
    # The backend tokenizer: no special tokens added, no "longer than model_max_length" warnings.
    encodings = tokenizer.backend_tokenizer.encode_batch(documents, add_special_tokens=False)
    stream: list[int] = []
    for encoding in encodings:
        stream.append(tokenizer.bos_token_id)
        stream.extend(encoding.ids)
        stream.append(tokenizer.eos_token_id)
    num_rows = len(stream) // seq_len
    return torch.tensor(stream[: num_rows * seq_len], dtype=torch.long).view(num_rows, seq_len)


def _lr_at(step: int, settings: PretrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return settings.lr * (settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * cosine)


def _mean_loss(model: PreTrainedModel, rows: torch.Tensor, settings: PretrainSettings) -> float:
    """Mean next-token loss over `rows`, every row having the same number of predicted tokens."""
    model.eval()
    losses = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
        for batch in rows.split(settings.micro_batch_size):
            losses.append(model(input_ids=batch, labels=batch, use_cache=False).loss.float() * len(batch))
    return float(torch.stack(losses).sum() / len(rows))


def _make_optimizer(model: PreTrainedModel, settings: PretrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: decaying them only hurts
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )


def _step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    labels: torch.Tensor,
    settings: PretrainSettings,
) -> float:
    """One optimizer step on a `(B, T)` batch; returns its loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16_autocast):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _split_rows(
    rows: torch.Tensor,
    settings: PretrainSettings,
    extra_rows: tuple[torch.Tensor, torch.Tensor] | None,
    train_on_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(training ids, training labels, held-out rows): the held-out rows are the last of `rows`."""
    assert len(rows) > settings.heldout_rows, "corpus too small for the held-out rows"
    train_ids, heldout_rows = rows[: -settings.heldout_rows], rows[-settings.heldout_rows :]
    if extra_rows is None:
        return train_ids, train_ids, heldout_rows
    if not train_on_rows:
        return extra_rows[0], extra_rows[1], heldout_rows
    return torch.cat([train_ids, extra_rows[0]]), torch.cat([train_ids, extra_rows[1]]), heldout_rows


def pretrain(
    model: PreTrainedModel,
    rows: torch.Tensor,
    settings: PretrainSettings,
    progress: Callable[[str], None] = lambda message: None,
    extra_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    probe: Callable[[], str] = lambda: "",
    train_on_rows: bool = True,
) -> PretrainResult:
    """Train every parameter of `model` on `rows` (and `extra_rows`) for `settings.steps` steps, in place.

    Args:
        model: a freshly initialised causal LM (float32 weights).
        rows: `(num_rows, seq_len)` token ids from `token_rows`; the last `settings.heldout_rows` are held out.
        settings: steps, batch size, learning rate and schedule.
        progress: called with a one-line message every tenth of the run.
        extra_rows: `(ids, labels)` of further training rows of the same length (`synthetic_rows`), labels
            -100 where no loss is taken; shuffled in with the others.
        probe: called (model in eval mode) at each progress message; what it returns is appended.
        train_on_rows: False trains on `extra_rows` alone (`rows` then only supply the held-out rows).
    """
    train_ids, train_labels, heldout_rows = _split_rows(rows, settings, extra_rows, train_on_rows)
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = _make_optimizer(model, settings)

    start_seconds = time.perf_counter()
    heldout_loss_before = _mean_loss(model, heldout_rows, settings)
    losses: list[float] = []
    order = torch.empty(0, dtype=torch.long)
    report_every_steps = max(1, settings.steps // 10)
    model.train()
    for step in range(settings.steps):
        if len(order) < settings.micro_batch_size:  # a new epoch: a fresh seeded permutation
            order = torch.cat([order, torch.randperm(len(train_ids), generator=generator)])
        batch = order[: settings.micro_batch_size]
        order = order[settings.micro_batch_size :]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        losses.append(_step(model, optimizer, train_ids[batch], train_labels[batch], settings))  # (B, T) rows
        if (step + 1) % report_every_steps == 0 or step + 1 == settings.steps:
            model.eval()
            elapsed = time.perf_counter() - start_seconds
            progress(f"pretraining step {step + 1}/{settings.steps}: loss {losses[-1]:.3f}{probe()} ({elapsed:.0f} s)")
            model.train()
    model.eval()
    heldout_loss_after = _mean_loss(model, heldout_rows, settings)

    tail = losses[-max(1, settings.steps // 10) :]
    return PretrainResult(
        steps=settings.steps,
        tokens_seen=settings.steps * settings.micro_batch_size * rows.shape[1],
        first_loss=losses[0],
        final_loss=sum(tail) / len(tail),
        heldout_loss_before=heldout_loss_before,
        heldout_loss_after=heldout_loss_after,
        seconds=time.perf_counter() - start_seconds,
    )
