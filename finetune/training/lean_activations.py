"""A decoder layer's RMSNorms and gated MLP that save less for backward than transformers' own, same outputs.

Under gradient checkpointing a step's peak is the frozen weights, the layer inputs and one layer recomputed
with everything it saves for backward; without it, every layer's. transformers' layers save, besides what LoRA
needs:
- in each RMSNorm, its input upcast to float32 (4 bytes per unit and token), and Gemma's also the float32
  normalised product, for the backward of `x * rsqrt(mean(x²) + eps)`; Gemma 2 and 3 have four such norms per
  layer, and Gemma 3 and Qwen 3 normalise each query and key head as well;
- in the MLP `down(act(gate(x)) * up(x))`, the activation's output beside its input and `up(x)` (autograd keeps
  the product's two factors and the activation's input).
`RMSNormFunction` keeps the input as it came (for the first norm that is the layer input, which the
checkpoint keeps anyway) and the float32 `rsqrt` per row, and recomputes the rest in the backward;
`GatedProduct` keeps `gate(x)` and `up(x)` and recomputes the activation (SiLU, or Gemma's tanh GeLU). (A
float32 input is its own float32 copy: there the norm keeps transformers' forward, and a float32 run trains bit
for bit as without them.) Their forwards are transformers' ops in transformers' order, so outputs are bit for
bit the same; `GatedProduct`'s gradients are too (the same aten kernels on the same operands),
`RMSNormFunction`'s equal autograd's to float32 rounding. On Llama 3.1 8B at 2 x 2048 tokens in bf16 that is
0.2 GiB less in the recomputed layer; on a Gemma 3 layer in bf16 a third of what it saves (`finetune plan`
counts both: `finetune.plan.memory.layer_activation_bytes_per_token`).

`use_lean_activations(model)` puts them into every module that computes exactly what they compute: a module
whose class is named `*RMSNorm` with a 1-D `weight` and Llama's `variance_epsilon` (or, named `Gemma*RMSNorm`,
Gemma's `eps`), or that has `gate_proj`, `up_proj`, `down_proj` and a SiLU or tanh-GeLU `act_fn`, and whose
output on a probe input equals, bit for bit, what the lean forward gives (any other norm keeps its own forward).

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

GATE_ACTIVATIONS = ("silu", "gelu_tanh")
"""The gates `GatedProduct` computes: SiLU (Llama, Mistral, Qwen, Phi) and tanh-approximated GeLU (Gemma)."""


def _activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


class GatedProduct(torch.autograd.Function):
    """act(gate) * up, keeping only `gate` and `up` for the backward; `activation` is one of `GATE_ACTIVATIONS`."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return _activate(gate, activation) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            if ctx.activation == "silu":
                grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
            else:
                grad_gate = torch.ops.aten.gelu_backward(grad * up, gate, approximate="tanh")
        if ctx.needs_input_grad[1]:
            grad_up = grad * _activate(gate, ctx.activation)
        return grad_gate, grad_up, None


class RMSNormFunction(torch.autograd.Function):
    """x·rsqrt(mean(x²) + eps) in float32 times a frozen weight, keeping x and the float32 rsqrt per row. Two
    roundings, as transformers writes them: Llama's `weight * normed.to(dtype)` (`offset` None), and Gemma's
    `(normed * (offset + weight.float())).to(dtype)` (`offset` 1.0: its weights are stored as w - 1)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float | None) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        if offset is None:
            return weight * (x32 * rstd).to(x.dtype)
        return (x32 * rstd * (offset + weight.float())).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        if ctx.offset is None:  # the gradient reaching x·rstd, rounded as autograd rounds it
            grad_normed = (grad * weight).to(torch.float32)
        else:
            grad_normed = grad.to(torch.float32) * (ctx.offset + weight.float())
        mean_term = (grad_normed * x32).sum(-1, keepdim=True) * rstd.pow(3) / x.shape[-1]
        return (grad_normed * rstd - x32 * mean_term).to(x.dtype), None, None, None


def _lean_norm(module: Any, eps: float, offset: float | None) -> Any:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if module.weight.requires_grad or hidden_states.dtype == torch.float32:  # float32: autograd copies nothing
            return type(module).forward(module, hidden_states)
        return RMSNormFunction.apply(hidden_states, module.weight, eps, offset)

    return forward


def _lean_mlp(module: Any, activation: str) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(GatedProduct.apply(module.gate_proj(x), module.up_proj(x), activation))

    return forward


def _lean_fused_mlp(module: Any, activation: str) -> Any:
    """Phi-3's MLP: one `gate_up_proj` whose output halves are the gate and the up projection."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
        return module.down_proj(GatedProduct.apply(gate, up, activation))

    return forward


def _gate_activation(act: Any) -> str | None:
    """Which of `GATE_ACTIVATIONS` the module `act` computes, by its type (the probe then checks the outputs)."""
    if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
        return "silu"
    if type(act).__name__ in ("GELUTanh", "PytorchGELUTanh"):
        return "gelu_tanh"
    return None


def _norm_candidate(module: Any) -> tuple[Any, int] | None:
    """A `*RMSNorm` with a 1-D weight: Llama's (`variance_epsilon`) or Gemma's (`eps`, `1 + weight`)."""
    weight = getattr(module, "weight", None)
    if not (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1):
        return None
    if hasattr(module, "variance_epsilon"):
        return _lean_norm(module, float(module.variance_epsilon), None), int(weight.shape[0])
    if "Gemma" in type(module).__name__ and isinstance(getattr(module, "eps", None), float):
        return _lean_norm(module, module.eps, 1.0), int(weight.shape[0])
    return None


def _candidate(module: Any) -> tuple[Any, int] | None:
    """The lean forward `module` may take and the width of its input, or None."""
    if "forward" in module.__dict__:
        return None
    norm = _norm_candidate(module)
    if norm is not None:
        return norm
    for projections, act_name, lean in (
        (("gate_proj", "up_proj", "down_proj"), "act_fn", _lean_mlp),
        (("gate_up_proj", "down_proj"), "activation_fn", _lean_fused_mlp),
    ):
        if not all(hasattr(module, name) for name in (*projections, act_name)):
            continue
        others = [child for name, child in module.named_children() if name not in projections]
        # a dropout of the MLP's own acts in training mode only, where the eval-mode probe cannot see it
        dropout = any(isinstance(child, torch.nn.Dropout) for child in others)
        activation = _gate_activation(getattr(module, act_name))
        if not dropout and activation is not None:
            return lean(module, activation), int(getattr(module, projections[0]).in_features)
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
