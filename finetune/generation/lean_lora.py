"""peft's LoRA linear layers as plain matrix products while a model generates.

peft's `lora.Linear.forward` checks its arguments, looks up the active adapters and calls four modules (the
base layer, dropout, A, B) per layer on every call. A decode step of a small model is made of such calls:
on the embedded base (28 LoRA layers, 32 rows) peft's forwards were about 40% of a sampling step's time
on the CPU (cProfile), most of it bookkeeping. Inside `lean_lora`, each plain LoRA layer (one active
adapter, no DoRA or other variant, not merged, an `nn.Linear` base without hooks) computes the same
products in the same order as peft does (`base(x) + B(A(x)) * scaling`, the input cast to A's dtype),
so its output is bit for bit peft's; anything else keeps peft's forward. Dropout is skipped, so it
applies only to a model in eval mode (generation); a module in training mode is left alone.

Example:
    model.eval()
    with lean_lora(model), torch.inference_mode():
        logits = model(input_ids=ids).logits
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F


@contextmanager
def lean_lora(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, the model's plain LoRA linear layers run as matrix products; yields how many."""
    patched = []
    for module in model.modules():
        forward = lean_forward(module)
        if forward is not None:
            module.forward = forward
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # the class's forward again


def unhooked(module: torch.nn.Module) -> bool:
    """No forward hooks and no forward replaced on the instance (accelerate's offloading, a wrapper's)."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def plain_lora_parts(
    module: Any, *, eval_only: bool = True
) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear, float] | None:
    """(base, A, B, scaling) of a plain peft LoRA linear layer in eval mode, else None: one active adapter,
    no DoRA or other variant, not merged, not disabled, `nn.Linear` base and factors without hooks.
    `eval_only=False`: the same question of a layer in training mode (as it will be when evaluated)."""
    kind = type(module)
    if kind.__name__ != "Linear" or not kind.__module__.startswith("peft.tuners.lora"):
        return None
    base = getattr(module, "base_layer", None)
    if (
        type(base) is not torch.nn.Linear
        or (eval_only and module.training)
        or not unhooked(module)
        or not unhooked(base)
    ):
        return None
    if module.disable_adapters or module.merged or getattr(module, "fan_in_fan_out", False):
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if len(active) != 1 or active[0] in getattr(module, "lora_variant", {}):
        return None
    lora_a, lora_b = module.lora_A[active[0]], module.lora_B[active[0]]
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return None
    if not unhooked(lora_a) or not unhooked(lora_b):
        return None
    return base, lora_a, lora_b, module.scaling[active[0]]


def lean_forward(module: Any) -> Callable[..., torch.Tensor] | None:
    """The lean forward of a plain peft LoRA linear layer in eval mode, else None (peft's forward stays)."""
    parts = plain_lora_parts(module)
    if parts is None:
        return None
    base, lora_a, lora_b, scaling = parts
    cast = getattr(module, "cast_input_dtype_enabled", True)

    def forward(x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, base.weight, base.bias)
        if cast and x.dtype != lora_a.weight.dtype:
            x = x.to(lora_a.weight.dtype)
        update = F.linear(F.linear(x, lora_a.weight, lora_a.bias), lora_b.weight, lora_b.bias)
        return (result + update * scaling).to(result.dtype)

    return forward
