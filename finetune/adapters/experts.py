"""Fused mixture-of-experts tensors: finding them in a model by structure, and naming an adapter's LoRA on them.

transformers 5 stores each MoE layer's experts fused, as 3D parameters of one module
(`mlp.experts.gate_up_proj`: experts x out x in, or experts x in x out where the module says `is_transposed`,
as gpt-oss does). They are not `nn.Linear`, so LoRA reaches them only through peft's `target_parameters`,
which wraps the owning module in a `ParamWrapper`; several targeted parameters of one module give nested
wrappers, and peft saves their LoRA under the owner's name with one `.base_layer` per level
(`mlp.experts.lora_A.weight`, `mlp.experts.base_layer.lora_A.weight`). Experts are found by structure,
not by family name: a 3D parameter is a stack of experts. The router is the sibling module whose weight
has one row per expert (`mlp.gate`, `mlp.router`).

Example:
    experts = expert_tensors(model)             # [ExpertTensor('model.layers.0.mlp.experts', 'down_proj', ...), ...]
    adapter = bind_experts(read_adapter("adapters/moe"), model)
    adapter.modules["model.layers.0.mlp.experts.down_proj"].delta()   # (experts, out, in) in fp32
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from finetune.adapters.lora import Adapter, LoraWeights, lora_scale, pattern_rank
from finetune.errors import AdapterError

BASE_LAYER = ".base_layer"


@dataclass(frozen=True)
class ExpertTensor:
    """One fused expert parameter: `owner.parameter`, of shape `shape`."""

    owner: str
    """The module holding it (`model.layers.0.mlp.experts`)."""
    parameter: str
    shape: tuple[int, ...]
    transposed: bool
    """Stored (experts, in, out) rather than (experts, out, in) (the module's `is_transposed`, peft reads it too)."""

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.parameter}"

    @property
    def num_experts(self) -> int:
        return self.shape[0]


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with peft's wrappers (`base_layer` chains, `ParamWrapper` nesting) taken off."""
    while hasattr(module, "base_layer") and isinstance(module.base_layer, torch.nn.Module):
        module = module.base_layer
    return module


def expert_tensors(model: torch.nn.Module) -> list[ExpertTensor]:
    """Every 3D parameter of `model` but a convolution's (peft's own LoRA layers and wrappers looked through), in
    module order."""
    found: list[ExpertTensor] = []
    for name, module in model.named_modules():
        if "lora_" in name or BASE_LAYER.lstrip(".") in name.split("."):
            continue
        owner = unwrapped(module)
        if isinstance(owner, torch.nn.modules.conv._ConvNd):  # a convolution's 3D weight (linear attention's conv1d)
            continue
        for parameter, tensor in owner.named_parameters(recurse=False):
            shape = tuple(getattr(tensor, "ds_shape", tensor.shape))
            if len(shape) == 3:
                transposed = bool(getattr(owner, "is_transposed", False))
                found.append(ExpertTensor(clean_name(name), parameter, shape, transposed))
    return found


def clean_name(name: str) -> str:
    """A module name without peft's prefix and wrapper levels (`base_model.model.x.base_layer` -> `x`)."""
    name = name.removeprefix("base_model.model.")
    while name.endswith(BASE_LAYER):
        name = name.removesuffix(BASE_LAYER)
    return name


def routers(model: torch.nn.Module, experts: list[ExpertTensor]) -> list[str]:
    """Names of the routers: siblings of an experts module whose weight has one row per expert, or whose only
    weight is a submodule's with one row per expert (JetMoE's `router.layer`, HunYuan-MoE's `gate.wg`: an
    `nn.Linear` that `all-linear` would otherwise train, and no router to `train_router`)."""
    names = {name: module for name, module in model.named_modules()}
    found: list[str] = []
    for owner in sorted({(e.owner, e.num_experts) for e in experts}):
        parent_name, _, own = owner[0].rpartition(".")
        parent = names.get(parent_name) if parent_name else model
        if parent is None:
            continue
        for child_name, child in parent.named_children():
            inner = _router_weight_holder(child, owner[1]) if child_name != own else None
            if inner is not None:
                name = ".".join(part for part in (parent_name, child_name, inner) if part)
                found.append(name)
    return sorted(set(found))


def _router_weight_holder(module: torch.nn.Module, experts: int) -> str | None:
    """'' when `module`'s own weight has one row per expert; the name of the submodule holding its only weight
    when that one does (peft's LoRA layers and wrappers looked through); None otherwise."""
    own = getattr(unwrapped(module), "weight", None)
    if isinstance(own, torch.Tensor):
        return "" if _rows(own) == experts else None
    holders = [
        (name, weight)
        for name, sub in module.named_modules()
        if name and not any(part.startswith("lora_") or part == "base_layer" for part in name.split("."))
        for weight in [getattr(unwrapped(sub), "weight", None)]
        if isinstance(weight, torch.Tensor)
    ]
    if len(holders) == 1 and _rows(holders[0][1]) == experts:
        return holders[0][0]
    return None


def _rows(weight: torch.Tensor) -> int | None:
    """The rows of a 2D weight (its full shape under DeepSpeed ZeRO-3), None for another rank."""
    shape = tuple(getattr(weight, "ds_shape", weight.shape))
    return shape[0] if len(shape) == 2 else None


def matches_target(name: str, targets: list[str]) -> bool:
    """peft's rule for `target_parameters`: the full name, or a suffix after a dot."""
    return any(name == target or name.endswith("." + target) for target in targets)


def nesting_order(owner_parameters: list[str], targets: list[str], owner: str) -> list[str]:
    """The targeted parameters of one module from the innermost wrapper to the outermost, as peft creates them.

    peft walks the module's parameters in registration order and wraps each match around the previous
    wrapper, so the first one registered is innermost (deepest `.base_layer` chain in the saved names).
    """
    return [p for p in owner_parameters if matches_target(f"{owner}.{p}", targets)]


def bind_experts(adapter: Adapter, model: torch.nn.Module) -> Adapter:
    """`adapter` with its LoRA on expert tensors keyed by the tensors' names and told their layout.

    Modules of other kinds are kept as they are. Raises `AdapterError` when a saved wrapper key names no
    targeted expert tensor of `model` (another architecture) or its expert count differs.
    """
    targets = list(adapter.config.get("target_parameters") or [])
    if not targets and not any(lora.num_experts > 1 for lora in adapter.modules.values()):
        return adapter
    by_owner: dict[str, list[ExpertTensor]] = {}
    for tensor in expert_tensors(model):
        by_owner.setdefault(tensor.owner, []).append(tensor)
    modules: dict[str, LoraWeights] = {}
    for key, lora in adapter.modules.items():
        if lora.num_experts == 1 and clean_name(key) not in by_owner:
            modules[key] = lora
            continue
        tensor = _wrapped_tensor(adapter, key, by_owner, targets)
        # peft keys rank_pattern/alpha_pattern of a parameter target by the tensor's own name
        # (`...mlp.experts.down_proj`), not by the wrapper key the file stores it under: only now is it known.
        rank = pattern_rank(adapter.config, tensor.name)
        if lora.A.shape[0] != rank * tensor.num_experts or lora.B.shape[1] != lora.A.shape[0]:
            held = lora.A.shape[0] // rank if rank > 0 and lora.A.shape[0] % rank == 0 else lora.num_experts
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.path}): {tensor.name} has {tensor.num_experts} experts in the base "
                f"but the adapter's LoRA has {held} (rank {rank}): it was trained on another base"
            )
        scale = lora_scale(adapter.config, tensor.name, rank)
        modules[tensor.name] = replace(
            lora, num_experts=tensor.num_experts, scale=scale, transposed=tensor.transposed, parameter=tensor.parameter
        )
    return replace(adapter, modules=modules)


def _wrapped_tensor(
    adapter: Adapter, key: str, by_owner: dict[str, list[ExpertTensor]], targets: list[str]
) -> ExpertTensor:
    """The expert tensor a saved wrapper key (`owner` + `.base_layer` x depth) holds LoRA for."""
    depth = len(re.findall(re.escape(BASE_LAYER) + "(?=$|\\.)", key))
    owner = clean_name(key)
    tensors = by_owner.get(owner, [])
    order = nesting_order([t.parameter for t in tensors], targets, owner)
    if depth >= len(order):
        raise AdapterError(
            f"adapter {adapter.name!r} ({adapter.path}) holds expert LoRA for {key}, which names no targeted expert "
            "tensor of the base: it was trained on another architecture"
        )
    parameter = order[len(order) - 1 - depth]
    return next(t for t in tensors if t.parameter == parameter)


def peft_rewritten_names(model: torch.nn.Module) -> frozenset[str]:
    """Linear layer names plain peft moves onto the experts when it loads an adapter for this model's family
    (`peft_target_rewrite_off` says why), e.g. {'gate', 'gate_proj', 'up_proj', 'down_proj'} for DeepSeek-V3 and
    the other families transformers converts as it does Qwen2-MoE; empty for the rest (or another peft)."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        return frozenset()
    pattern = _MODEL_TO_CONVERSION_PATTERN.get(str(getattr(getattr(model, "config", None), "model_type", "")))
    return frozenset(_MOE_TARGET_MODULE_MAPPING.get(pattern, {}) if pattern else ())


@contextmanager
def peft_target_rewrite_off() -> Iterator[None]:
    """Inside the block, peft takes `target_modules` and `target_parameters` as given.

    peft 0.21 rewrites the targets of families whose checkpoints transformers 5 converts (Mixtral, Qwen2-MoE
    and those mapped to them): any target named `gate`, `gate_proj`, `up_proj` or `down_proj` becomes an
    expert parameter (`convert_peft_config_for_transformers`, meant for adapters trained under transformers 4).
    On a model whose dense MLPs or shared experts use those names (DeepSeek-style, Qwen2-MoE), that moves
    LoRA off the dense layers and onto the experts or the router. Our targets are computed for this model,
    so the rewrite is switched off while peft wraps it.
    """
    import peft.utils.transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original
