"""The chunked linear cross-entropy: the same losses and gradients as whole logits, at a fraction of the memory.

- `token_losses` against `F.cross_entropy(head(hidden).float())` on a frozen linear head (the fused path that
  computes the gradient in the forward) and on a LoRA head (the checkpointed path), with chunks that do not
  divide the rows, and a non-uniform incoming gradient (a preference loss weights tokens unequally);
- a whole SFT step through the tiny model: the loss and LoRA gradients of the new path against today's
  `forward_loss` (boolean-mask selection, whole logits);
- the loss's peak memory at Llama-3's 128,256-token vocabulary and 2 x 2048 tokens, measured by torch's
  `MemTracker` on fake tensors (nothing is allocated: the measurement takes a second), against the whole-logits
  loss: at most 1/8 of it, as the issue asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import REORDERED_ULPS, ROUNDED_ULPS, assert_within_ulps
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from finetune.chunked_loss import rows_per_chunk, token_losses

MiB = 2**20


def _whole(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction="none")


def _losses_and_gradient(function, head, hidden, targets, weights):
    hidden = hidden.detach().clone().requires_grad_(True)
    losses = function(head, hidden, targets)
    (losses * weights).sum().backward()
    return losses.detach(), hidden.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_linear_head_equals_whole_logits(dtype):
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=True).to(dtype).requires_grad_(False)
    hidden = torch.randn(50, 32, generator=generator).to(dtype)
    targets = torch.randint(0, 300, (50,), generator=generator)
    weights = torch.rand(50, generator=generator) + 0.5
    expected, expected_grad = _losses_and_gradient(_whole, head, hidden, targets, weights)
    chunked, chunked_grad = _losses_and_gradient(
        lambda h_, x, t: token_losses(h_, x, t, chunk_rows=7), head, hidden, targets, weights
    )
    assert chunked.dtype == torch.float32
    # log-sum-exp minus the target's logit instead of log-softmax: a float32 ulp or two (2.4e-7). In bf16 the
    # 7-row matmul may round a logit to the other neighbouring bf16 value than the 50-row one (4e-6 observed).
    torch.testing.assert_close(chunked, expected, rtol=5e-7 if dtype == torch.float32 else 2e-5, atol=0)
    # The incoming gradient scales rows after the matmul instead of before, and each entry is a sum of 300
    # products that cancel: ulps of the gradient's largest entry (observed: 10 in float32; the bound grows with
    # the 300 terms), a bf16 rounding or two.
    ulp = torch.finfo(dtype).eps * expected_grad.abs().max().item()
    torch.testing.assert_close(chunked_grad, expected_grad, rtol=2 * torch.finfo(dtype).eps, atol=32 * ulp)


def test_lora_head_is_checkpointed_per_chunk_and_equals_whole_logits():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        torch.nn.Sequential(torch.nn.Linear(32, 300)), LoraConfig(r=4, lora_alpha=8, target_modules=["0"])
    )
    head = model.base_model.model[0]
    with torch.no_grad():
        head.lora_B["default"].weight.normal_()
    hidden, targets = torch.randn(50, 32), torch.randint(0, 300, (50,))
    weights = torch.rand(50) + 0.5
    results = []
    for function in (_whole, lambda h_, x, t: token_losses(h_, x, t, chunk_rows=7)):
        model.zero_grad()
        losses, hidden_grad = _losses_and_gradient(function, head, hidden, targets, weights)
        lora_grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        results.append((losses, hidden_grad, lora_grads))
    (expected, expected_hidden, expected_lora), (chunked, chunked_hidden, chunked_lora) = results
    assert_within_ulps(chunked, expected, ROUNDED_ULPS, what="losses")  # log-sum-exp minus the target's logit
    # Each hidden-gradient entry is a sum of 300 products that cancel, and the LoRA gradients are summed over 8
    # chunks instead of at once: the same sums in another order, in ulps of each tensor's largest entry (an
    # entry 40x smaller than the largest was 4e-5 apart relatively on an AMD EPYC, 2 ulps of the largest).
    assert_within_ulps(chunked_hidden, expected_hidden, REORDERED_ULPS, what="hidden gradient")
    for ours, theirs in zip(chunked_lora, expected_lora):
        assert_within_ulps(ours, theirs, REORDERED_ULPS, what="LoRA gradient")


def test_sft_step_equals_the_whole_logits_loss(tiny_base_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.data.collate import collate_batch
    from finetune.scoring import forward_loss
    from finetune.training.objectives.logprobs import add_targets
    from finetune.training.target_loss import target_losses

    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32), lora)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.2)
    documents = [
        {"input_ids": list(range(5, 5 + n)), "labels": [-100] * (n // 2) + list(range(5 + n // 2, 5 + n))}
        for n in (9, 17, 4, 30)
    ]
    batch = add_targets(collate_batch(documents, 0, packing=True, document_index=True))  # the 4D mask too
    results = []
    for loss_of in (lambda: forward_loss(model, batch)[0], lambda: target_losses(model, batch).sum()):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    (expected, expected_grads), (ours, our_grads) = results
    assert_within_ulps(ours, expected, REORDERED_ULPS, what="loss")  # a mean of chunked sums (2 ulps seen)
    for mine, theirs in zip(our_grads, expected_grads):  # the same sums, chunked: in ulps of the largest entry
        assert_within_ulps(mine, theirs, REORDERED_ULPS, what="LoRA gradient")


def _loss_peak_bytes(function, tokens: int, vocab: int, hidden_size: int) -> int:
    """Peak bytes the loss adds above its inputs (the head, the hidden states), forward and backward, measured
    by `MemTracker` on fake tensors."""
    with FakeTensorMode():
        head = torch.nn.Linear(hidden_size, vocab, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        hidden = torch.randn(tokens, hidden_size, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (tokens,))
        tracker = MemTracker()
        tracker.track_external(head, hidden, targets)
        with tracker:
            start = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("current").values())
            function(head, hidden, targets).sum().backward()
        peak = sum(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    return peak - start


def test_loss_peak_at_128k_vocabulary_is_an_eighth_of_whole_logits():
    tokens, vocab, hidden_size = 2 * 2048, 128_256, 4096  # Llama-3.1-8B at 2 x 2048
    # `head.forward`: MemTracker's module hooks refuse a frozen weight; the loss's memory is the same.
    whole = _loss_peak_bytes(lambda h_, x, t: _whole(h_.forward, x, t), tokens, vocab, hidden_size)
    chunked = _loss_peak_bytes(token_losses, tokens, vocab, hidden_size)
    print(f"loss peak at {tokens} x {vocab}: whole logits {whole / MiB:,.0f} MiB, chunked {chunked / MiB:,.0f} MiB")
    assert rows_per_chunk(vocab) < tokens
    assert whole >= tokens * vocab * 10  # bf16 logits, their float32 copy and the float32 log-softmax at least
    assert chunked * 8 <= whole
