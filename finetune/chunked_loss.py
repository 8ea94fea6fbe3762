"""Linear cross-entropy in chunks: token losses from hidden states, never holding the (tokens x vocabulary) logits.

The output head of a causal LM turns N hidden states (N, H) into N x V logits; with a 128k vocabulary and
2 x 2048 tokens those are 2 GiB in float32, and the softmax, its float32 copy and its gradient hold several
such tensors at once: the loss was the peak of a LoRA step. Here the rows go through the head in chunks of
`rows_per_chunk` (about 2^25 logits each), and only the chunk's logits are alive at any moment:

- a plain `nn.Linear` head whose weight takes no gradient (the base's head under LoRA): `LinearCrossEntropy`
  computes each chunk's loss and its gradient with respect to the hidden states in the forward pass (the
  gradient of a cross-entropy is softmax - one-hot, known as soon as the logits are), keeps that (N, H)
  gradient and drops the logits. The backward only scales it by the incoming gradient. No logit is computed
  twice. This is what Liger Kernel's fused linear cross-entropy does in triton, in plain PyTorch ops.
- any other head (LoRA on the head, a head whose weight trains, a quantized head): each chunk runs under
  activation checkpointing, so its logits are recomputed in the backward instead of kept.

The logits are computed as the head computes them (its dtype, under the caller's autocast), then upcast to
float32 before the softmax, as `finetune.scoring` does: the losses equal the unchunked ones and the
hidden-state gradients equal autograd's to float32 rounding (the incoming gradient scales the rows after the
matmul instead of before).

Example:
    losses = token_losses(model.lm_head, hidden, targets)   # (N,) float32, differentiable in `hidden`
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOGITS_PER_CHUNK = 1 << 25
"""About 32M logits per chunk (128 MiB in float32): 261 rows of a 128k vocabulary. Large enough that the
chunk's matmul is efficient (261 x 4096 x 128k), small enough that the loss is no longer the step's memory peak:
MemTracker measured the loss's peak at 2 x 2048 tokens and 128,256 words at 352 MiB (whole logits: 6,012 MiB),
about 10 bytes per logit of a chunk plus the (N, H) hidden-state gradient."""


def rows_per_chunk(vocab_size: int, logits_per_chunk: int = LOGITS_PER_CHUNK) -> int:
    """Rows of hidden states per chunk so that a chunk holds about `logits_per_chunk` logits."""
    return max(1, logits_per_chunk // max(vocab_size, 1))


def token_losses(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """(N,) float32 cross-entropy of each row of `hidden` (N, H) through `head` against `targets` (N,).

    Every target must be a real token id (select the labelled positions first: no ignore index here).
    `softcap`: the logits are capped first, `softcap * tanh(logits / softcap)` in the head's dtype, as Gemma 2's
    forward caps them after its head (`final_logit_softcapping`); such chunks take the checkpointed path.
    """
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if weight is not None else _vocab_of(head, hidden)
    rows = chunk_rows or rows_per_chunk(vocab)
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    if softcap is None and type(head) is torch.nn.Linear and not head.weight.requires_grad:
        # with or without a gradient (evaluation, reference passes): the same arithmetic, so that a policy equal to
        # its reference scores the same log-probabilities bit for bit (F.cross_entropy's differ in the last bits:
        # a DPO step from the reference logged rewards of 1e-5 and a reward accuracy of 0.125)
        bias = head.bias.detach() if head.bias is not None else None
        return LinearCrossEntropy.apply(hidden, head.weight.detach(), bias, targets, rows)
    pieces = list(zip(hidden.split(rows), targets.split(rows)))
    if not (torch.is_grad_enabled() and hidden.requires_grad):  # evaluation, reference passes: losses only
        return torch.cat([_chunk_losses(head, h, t, softcap) for h, t in pieces])
    return torch.cat([checkpoint(_chunk_losses, head, h, t, softcap, use_reentrant=False) for h, t in pieces])


def _vocab_of(head: torch.nn.Module, hidden: torch.Tensor) -> int:
    out_features = getattr(head, "out_features", None)
    if out_features is not None:
        return int(out_features)
    with torch.no_grad():
        return int(head(hidden[:1]).shape[-1])


def _chunk_losses(head: Any, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = head(hidden)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, reduction="none")


class LinearCrossEntropy(torch.autograd.Function):
    """Chunked cross-entropy through a frozen linear head, the hidden states' gradient computed in the forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk_rows: int,
    ) -> torch.Tensor:
        want_grad = ctx.needs_input_grad[0]
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad else None
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = F.linear(hidden[rows], weight, bias)  # the head's dtype (autocast applies as in the head)
            compute_dtype = logits.dtype
            logits32 = logits.float()  # the only (n, V) tensor alive from here on, rewritten in place
            del logits
            chunk_targets = targets[rows].unsqueeze(1)
            target_logits = logits32.gather(1, chunk_targets)  # (n, 1)
            shift = logits32.amax(dim=1, keepdim=True)
            exps = logits32.sub_(shift).exp_()
            totals = exps.sum(dim=1, keepdim=True)
            losses[rows] = (totals.log() + shift - target_logits).squeeze(1)  # log Σ exp − the target's logit
            if grad_hidden is not None:
                grad_logits = exps.div_(totals)  # softmax
                grad_logits.scatter_add_(1, chunk_targets, grad_logits.new_full(chunk_targets.shape, -1.0))
                grad_hidden[rows] = grad_logits.to(compute_dtype) @ weight.to(compute_dtype)  # (n, H)
            del logits32, exps
        if grad_hidden is not None:
            ctx.save_for_backward(grad_hidden)
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple:
        (grad_hidden,) = ctx.saved_tensors
        grad = grad_hidden * grad_losses.unsqueeze(1).to(grad_hidden.dtype)
        return grad, None, None, None, None
