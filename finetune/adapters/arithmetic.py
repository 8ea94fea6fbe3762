"""The one formula every merge, subtract and swap goes through, in memory and on disk.

    W = round_to_dtype( W_base + Σ wᵢ·ΔWᵢ )      summed in fp32, adapters in sorted-name order

Computing each touched tensor from the pristine base with this function, and nothing else, is what makes
subtracting everything give the base bit for bit and `swap(a, b)` equal a fresh merge of `b`: the same
inputs always round the same way, and no rounding error from an earlier state survives.

Example:
    terms = module_terms(ledger, adapters)["model.layers.0.self_attn.q_proj"]
    weight = merged_weight(pristine_q_proj, terms, torch.bfloat16, module="model.layers.0.self_attn.q_proj")
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from finetune.adapters.ledger import Ledger
from finetune.adapters.lora import Adapter, LoraWeights
from finetune.errors import AdapterError

Term = tuple[str, float, LoraWeights]
"""(adapter name, weight, its LoRA weights for one module)."""

MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def module_terms(weights: Mapping[str, float], adapters: Mapping[str, Adapter]) -> dict[str, list[Term]]:
    """module name -> its terms, for the adapters named in `weights` (name -> weight), in canonical order."""
    terms: dict[str, list[Term]] = {}
    for name in sorted(weights):
        for module, lora in adapters[name].modules.items():
            terms.setdefault(module, []).append((name, weights[name], lora))
    return terms


def changed_modules(old: Ledger, new: Ledger, adapters: Mapping[str, Adapter]) -> list[str]:
    """Modules whose list of terms differs between two ledgers: the only tensors an operation rewrites."""
    old_terms, new_terms = module_terms(old.weights, adapters), module_terms(new.weights, adapters)

    def signature(terms: list[Term]) -> list[tuple[str, float]]:
        return [(name, weight) for name, weight, _ in terms]

    modules = set(old_terms) | set(new_terms)
    return sorted(m for m in modules if signature(old_terms.get(m, [])) != signature(new_terms.get(m, [])))


def merged_weight(
    base: torch.Tensor,
    terms: list[Term],
    dtype: torch.dtype,
    *,
    module: str,
    expert: int | None = None,
) -> torch.Tensor:
    """round(base + Σ w·ΔW) in `dtype`, summed in fp32 in the order of `terms` (sorted by name), on `base`'s device.

    Every update is computed where the base tensor lives (a GPU's for a model loaded there), so the
    result never mixes devices and the same inputs on the same device always give the same bits.

    A fused expert tensor (experts first) is merged one expert at a time into a new tensor: bit for bit the
    whole tensor's merge
    (elementwise fp32 sums of the same per-expert updates), holding one expert's slice in fp32 instead of
    the whole tensor and its update (for a 30B MoE's `gate_up_proj`, 12 MiB instead of 3 GiB).
    `expert`: `base` is that expert's slice, and so is each ΔW.

    Raises:
        AdapterError: the result holds NaN/Inf (an update that overflows `dtype`), naming module and adapters.
    """
    if expert is None and terms and terms[0][2].num_experts > 1:
        out = torch.empty(base.shape, dtype=dtype, device=base.device)
        for e in range(base.shape[0]):
            out[e] = merged_weight(base[e], terms, dtype, module=module, expert=e)
        return out
    accumulator = base.to(torch.float32, copy=True)
    for _, weight, lora in terms:
        accumulator.add_(lora.delta(weight, accumulator.device, expert=expert))
    result = accumulator.to(dtype)
    if terms and not _all_finite(result):
        names = ", ".join(name for name, _, _ in terms)
        raise AdapterError(
            f"merging {names} into {module} gives NaN/Inf in {str(dtype).removeprefix('torch.')}; refusing (lower the "
            "weight or merge in float32)"
        )
    return result


def _all_finite(values: torch.Tensor) -> bool:
    """`torch.isfinite(values).all()`, 9-28x faster: min and max propagate NaN, and an Inf is an extreme."""
    extremes = torch.aminmax(values)
    return bool(torch.isfinite(extremes.min) & torch.isfinite(extremes.max))


def half_ulp(values: torch.Tensor) -> torch.Tensor:
    """Half the spacing of representable numbers at each value of `values` (in its own dtype), as fp32.

    The largest error one round-to-nearest into that dtype can make at that magnitude.
    """
    mantissa_bits = MANTISSA_BITS[values.dtype]
    finfo = torch.finfo(values.dtype)
    magnitude = values.detach().to(torch.float32).abs().clamp_min(finfo.tiny)
    exponent = torch.floor(torch.log2(magnitude))
    return torch.exp2(exponent - mantissa_bits - 1)
