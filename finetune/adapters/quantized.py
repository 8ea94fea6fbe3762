"""bitsandbytes layers for adapter arithmetic: dequantize to fp32, build the merged dense layer, requantize.

An adapter trained on a 4-bit or 8-bit base learned its update against the *dequantized* weights, so a
merge is round(dequantize(W_q) + Σ w·ΔW) in a 16/32-bit dtype: the quantized layer is replaced by a
dense `nn.Linear`. The original quantized layer is the pristine source (smaller than the dense weight)
and is put back when nothing is merged into it any more, so subtracting everything restores it exactly.
Requantizing a merged layer (only when asked) rounds again; `requantize` returns the relative
Frobenius error that adds, so it can be printed.

Merging a checkpoint on disk for such an adapter applies the same round trip to the stored weights
(`quantized_linear` then `dequantize`), reproducing the weights the adapter was trained against.

Example:
    dense_weight = dequantize(layer)                      # fp32, (out, in)
    merged = dense_linear_like(layer, dense_weight.to(torch.bfloat16))
    requantized, relative_error = requantize(layer, merged.weight)
"""

from __future__ import annotations

import sys
from typing import Any, TypeGuard, cast

import torch

from finetune.quantization import Quantization


def _bnb():
    """bitsandbytes if something has loaded it, else None: a quantized layer can only exist once it is loaded
    (transformers imports it to quantize a base), and importing it just to ask costs seconds of start-up."""
    return sys.modules.get("bitsandbytes")


def is_quantized_linear(module: torch.nn.Module) -> TypeGuard[torch.nn.Linear]:
    """Whether `module` is a bitsandbytes 4-bit or 8-bit layer (both subclass `nn.Linear`)."""
    bnb = _bnb()
    return bnb is not None and isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def keep_float_kernels(model: torch.nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit layers for its bf16 CPU kernel (on AVX512-BF16 CPUs), in place.

    bitsandbytes 0.50 repacks a 4-bit layer at its first eval-mode forward on such a CPU: the block scales
    are rounded to bf16, the matmul runs in bf16, and later forwards, train-mode ones included, use the
    repacked weights. A run would then compute with other weights after its first evaluation than before
    it, a resumed run with other weights than an unbroken one, and `dequantize` would misread the packed
    layout. Measured here (64 x 64 layer): the eval forward was off by 2e-3 from the matmul with the
    dequantized weights (0 in train mode), and the dequantized weight read afterwards by 0.11. With the
    float kernels every forward computes with exactly the weights the adapter trains against (and the
    eval forward no longer needs out_features divisible by 32). GPUs are not affected.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            setattr(module, "support_avx512bf16_for_cpu", False)  # noqa: B010  # torch types module attributes as Tensor | Module


def dequantize(module: torch.nn.Module) -> torch.Tensor:
    """The weight a bitsandbytes linear layer computes with, in fp32, shaped (out, in)."""
    import bitsandbytes.functional as F

    bnb = _bnb()
    if isinstance(module, bnb.nn.Linear4bit):
        state = cast(Any, module.weight).quant_state
        assert not getattr(state, "packing_format_for_cpu", False), "repacked for bf16: see keep_float_kernels"
        return F.dequantize_4bit(module.weight.data, module.weight.quant_state).to(torch.float32)
    weight = cast(torch.Tensor, module.weight)  # torch types a module's attributes as Tensor | Module
    scales = getattr(weight, "SCB", None)
    if scales is None:
        scales = cast(Any, module.state).SCB  # Linear8bitLt's MatmulLtState, which torch types as Tensor | Module
    return F.int8_vectorwise_dequant(weight.data, scales).to(torch.float32)


def dense_linear_like(module: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Linear:
    """A plain `nn.Linear` holding `weight` (and the quantized layer's bias), in `weight`'s dtype."""
    bias = module.bias
    dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    dense.weight = torch.nn.Parameter(weight, requires_grad=False)
    if isinstance(bias, torch.Tensor):
        dense.bias = torch.nn.Parameter(bias.detach().to(weight.dtype).clone(), requires_grad=False)
    return dense


def quantized_linear(
    weight: torch.Tensor,
    quantization: Quantization,
    *,
    blocksize: int = 64,
    compute_dtype: torch.dtype | None = None,
    threshold: float = 0.0,
) -> torch.nn.Module:
    """A bitsandbytes layer holding `weight` quantized as transformers' loader quantizes a checkpoint, on
    `weight`'s device (bitsandbytes quantizes when the parameter is moved to a device; CPU and CUDA kernels
    are its own, so a base is reproduced on the device it was quantized on).

    4-bit: `Params4bit` quantizes the weight as given (its dtype is what dequantization returns);
    8-bit: `Int8Params` rounds to fp16 first (on the host), then row-wise absmax int8 on the device.
    """
    import bitsandbytes as bnb  # loaded here when nothing has yet: the on-disk round trip loads no quantized model

    out_features, in_features = weight.shape
    layer: Any
    if quantization.bits == 4:
        layer = bnb.nn.Linear4bit(
            in_features,
            out_features,
            bias=False,
            compute_dtype=compute_dtype or weight.dtype,
            compress_statistics=quantization.double_quant,
            quant_type=quantization.quant_type,
            device="meta",
        )
        layer.weight = bnb.nn.Params4bit(
            weight.detach().clone(),
            requires_grad=False,
            compress_statistics=quantization.double_quant,
            quant_type=quantization.quant_type,
            blocksize=blocksize,
        )
    else:
        layer = bnb.nn.Linear8bitLt(
            in_features, out_features, bias=False, has_fp16_weights=False, threshold=threshold, device="meta"
        )
        # Int8Params quantizes only when it moves off the CPU (or within it): a weight already on a GPU would
        # stay fp16 with no scales (found on an H200). From the host, `.to` below quantizes on the device.
        layer.weight = bnb.nn.Int8Params(
            weight.detach().to("cpu", torch.float16, copy=True), requires_grad=False, has_fp16_weights=False
        )
    keep_float_kernels(layer)
    return layer.to(weight.device)


def requantize(module: torch.nn.Module, weight: torch.Tensor) -> tuple[torch.nn.Module, float]:
    """`weight` quantized the way `module` is, and the relative Frobenius error ‖deq(q(W)) − W‖ / ‖W‖ it adds."""
    import bitsandbytes as bnb

    if isinstance(module, bnb.nn.Linear4bit):
        state = cast(Any, module.weight).quant_state
        layer = quantized_linear(
            weight.to(state.dtype),
            Quantization("4bit", quant_type=state.quant_type, double_quant=state.nested),
            blocksize=state.blocksize,
            compute_dtype=module.compute_dtype,
        )
    else:
        threshold = cast(Any, module.state).threshold  # see dequantize
        layer = quantized_linear(weight, Quantization("8bit"), threshold=threshold)
    bias = module.bias
    if isinstance(bias, torch.Tensor):
        layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    exact = weight.detach().to(torch.float32)
    relative_error = (dequantize(layer) - exact).norm() / exact.norm().clamp_min(1e-30)
    return layer, float(relative_error)
