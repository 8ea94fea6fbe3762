"""peft's cast of each LoRA layer's input to the float32 LoRA weights, which training turns off under autocast
(`finetune.model._UnlessAutocast`): the same losses and gradients bit for bit, less kept for backward, and the
cast still made outside autocast, where a bf16 input cannot meet float32 weights."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model

from finetune.model import _UnlessAutocast
from finetune.recipe import LoraConfig


def _bf16_lora(dropout: float):
    from finetune.model import wrap_with_lora

    model = tiny_model("llama", hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    return wrap_with_lora(model, LoraConfig(r=8, alpha=16, dropout=dropout, target_modules="all-linear")).train()


def _always_cast(peft_model):
    """A copy whose LoRA layers cast their input as peft does by default."""
    plain = copy.deepcopy(peft_model)
    for module in plain.modules():
        if isinstance(getattr(module, "cast_input_dtype_enabled", None), _UnlessAutocast):
            module.cast_input_dtype_enabled = True
    return plain


def _step(model, ids: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, LoRA gradients and bytes kept for backward (parameters apart) of one forward and backward."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    torch.manual_seed(3)  # the same dropout masks in both models
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, sum(saved.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_under_autocast_the_same_gradients_and_no_more_kept(dropout):
    ours = _bf16_lora(dropout)
    for _, parameter in ours.named_parameters():
        if parameter.requires_grad:
            parameter.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(parameter.numel()))
    plain = _always_cast(ours)
    ids = torch.randint(1, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    loss, grads, kept = _step(ours, ids, autocast=True)
    plain_loss, plain_grads, plain_kept = _step(plain, ids, autocast=True)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(grads[name], plain_grads[name]) for name in grads)
    if dropout:  # each layer keeps its own dropped copy either way
        assert kept == plain_kept
    else:  # q, k and v share their input, gate and up theirs, instead of a copy each
        assert kept < plain_kept, (kept, plain_kept)


def test_outside_autocast_the_input_is_still_cast():
    ours = _bf16_lora(0.0)
    ids = torch.randint(1, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    switch = next(m.cast_input_dtype_enabled for m in ours.modules() if hasattr(m, "cast_input_dtype_enabled"))
    assert bool(switch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not bool(switch)
    loss, _, _ = _step(ours, ids, autocast=False)  # bf16 activations into float32 LoRA weights: needs the cast
    plain_loss, _, _ = _step(_always_cast(ours), ids, autocast=False)
    assert torch.equal(loss, plain_loss)
