"""A decoder layer's RMSNorm and gated MLP that save less for backward than transformers' own, same outputs.

Under gradient checkpointing a step's peak is the frozen weights, the layer inputs and one layer recomputed
with everything it saves for backward. transformers' Llama-style layer saves, besides what LoRA needs:
- in each RMSNorm, its input upcast to float32 (4 bytes per hidden unit and token, twice per layer) for the
  backward of `x * rsqrt(mean(x²) + eps)`;
- in the MLP `down(silu(gate(x)) * up(x))`, the SiLU's output beside its input and `up(x)` (autograd keeps
  the product's two factors and the SiLU's input).
`RMSNormFunction` keeps the input as it came (for the first norm that is the layer input, which the
checkpoint keeps anyway) and the float32 `rsqrt` per row, and recomputes the rest in the backward;
`SiluMul` keeps `gate(x)` and `up(x)` and recomputes the SiLU. (A float32 input is its own float32 copy:
there the norm keeps transformers' forward, and a float32 run trains bit for bit as without them.) Their
forwards are transformers' ops in transformers' order, so outputs are bit for bit the same; `SiluMul`'s
gradients are too (the same aten kernels on the same operands), `RMSNormFunction`'s equal autograd's to
float32 rounding. On Llama 3.1 8B
at 2 x 2048 tokens in bf16 that is 0.2 GiB less in the recomputed layer (`finetune plan` counts it:
`finetune.plan.memory.layer_activation_bytes_per_token`).

`use_lean_activations(model)` puts them into every module that computes exactly what they compute: a module
whose class is named `*RMSNorm` with `weight` and `variance_epsilon`, or that has `gate_proj`, `up_proj`,
`down_proj` and a SiLU `act_fn`, and whose output on a probe input equals, bit for bit, what the lean
forward gives (Gemma's `1 + weight` norm, say, keeps its own forward).

Compiled layers (`train.compile`) do without them: inductor's partitioner already recomputes cheap
elementwise results in the backward instead of saving them, and custom autograd functions made compiling
the tiny test model's layers about 3x slower on the CPU.

Example:
    use_lean_activations(model)   # before LoRA wraps it; returns how many modules were changed
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only `gate` and `up` for the backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


class RMSNormFunction(torch.autograd.Function):
    """weight * (x·rsqrt(mean(x²) + eps)) in float32, cast back to x's dtype (transformers' Llama RMSNorm), keeping
    x and the float32 rsqrt per row. The weight takes no gradient (a frozen base's norm)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        grad_normed = (grad * weight).to(torch.float32)  # the gradient reaching x·rstd, as autograd rounds it
        mean_term = (grad_normed * x32).sum(-1, keepdim=True) * rstd.pow(3) / x.shape[-1]
        return (grad_normed * rstd - x32 * mean_term).to(x.dtype), None, None


def _lean_norm(module: Any) -> Any:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if module.weight.requires_grad or hidden_states.dtype == torch.float32:  # float32: autograd copies nothing
            return type(module).forward(module, hidden_states)
        return RMSNormFunction.apply(hidden_states, module.weight, module.variance_epsilon)

    return forward


def _lean_mlp(module: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(SiluMul.apply(module.gate_proj(x), module.up_proj(x)))

    return forward


def _candidate(module: Any) -> tuple[Any, int] | None:
    """The lean forward `module` may take and the width of its input, or None."""
    if "forward" in module.__dict__:
        return None
    if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return _lean_norm(module), int(weight.shape[0])
    if all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        others = [child for name, child in module.named_children() if name not in ("gate_proj", "up_proj", "down_proj")]
        # a dropout of the MLP's own acts in training mode only, where the eval-mode probe cannot see it
        dropout = any(isinstance(child, torch.nn.Dropout) for child in others)
        act = module.act_fn
        if not dropout and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
            return _lean_mlp(module), int(module.gate_proj.in_features)
    return None


def _same_on_a_probe(module: torch.nn.Module, forward: Any, width: int) -> bool:
    """Whether `forward` gives the module's own output, bit for bit, on a small random input of `width`."""
    parameter = next(module.parameters())
    generator = torch.Generator(device=parameter.device).manual_seed(0)
    probe = torch.randn(2, width, generator=generator, device=parameter.device).to(parameter.dtype)
    with torch.no_grad():
        return torch.equal(type(module).forward(module, probe), forward(probe))


def use_lean_activations(model: torch.nn.Module) -> int:
    """Give every module of `model` that computes what they compute the lean forward; returns how many."""
    changed = 0
    for module in model.modules():
        candidate = _candidate(module)
        if candidate is not None and _probe_dtype_ok(module) and _same_on_a_probe(module, *candidate):
            module.forward = candidate[0]
            changed += 1
    return changed


def _probe_dtype_ok(module: torch.nn.Module) -> bool:
    """Only modules with whole floating-point weights on a real device are probed: a quantized MLP, or weights
    partitioned across processes (DeepSpeed ZeRO-3 loads them so), keep their own forward."""
    parameters = list(module.parameters())
    return bool(parameters) and all(
        p.dtype.is_floating_point
        and p.dtype.itemsize >= 2
        and p.numel() > 0
        and not p.is_meta
        and not hasattr(p, "ds_numel")
        for p in parameters
    )
