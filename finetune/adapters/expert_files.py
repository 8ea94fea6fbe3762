"""Fused expert tensors in checkpoints that store one tensor per expert (and per projection).

transformers 5 fuses experts when it loads (`mlp.experts.gate_up_proj`, experts x 2i x d) and, for most
families (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-style), splits them back when it saves
(`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`; Mixtral's router
`mlp.gate.weight` is renamed `block_sparse_moe.gate.weight` too, so routers are mapped the same way). Adapter arithmetic
works on the fused tensor, so this module maps one to the other with transformers' own reverse conversion
(`revert_weight_conversion`), applied once to a tensor whose values are their own flat positions: each
stored tensor then says exactly which elements of the fused one it holds, whatever renames, stacking and
concatenation the family's conversion does. No family is named here.

The position maps are computed when a fused tensor is touched and not kept (4 bytes per element while one
tensor is assembled or split), so the cost stays that of one expert tensor at a time.

Example:
    layout = ExpertLayout(model, index)          # model: the architecture (meta device is enough)
    layout.parts("model.layers.0.mlp.experts.down_proj")   # ['model.layers.0.mlp.experts.0.down_proj.weight', ...]
    fused = layout.read("model.layers.0.mlp.experts.down_proj", torch.float32)
    stored = layout.split("model.layers.0.mlp.experts.down_proj", fused)   # stored name -> tensor
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from finetune.adapters.experts import ExpertTensor, expert_tensors, routers, unwrapped


class ExpertLayout:
    """The fused expert tensors of a model whose checkpoint (`index`: name -> header with `.shape`) stores them apart."""

    def __init__(self, model: torch.nn.Module, index: Mapping):
        self._model = model
        self._index = index
        self.fused: dict[str, ExpertTensor] = {}
        """fused name -> the expert tensor, for those the checkpoint does not store under their own name."""
        self._parts: dict[str, list[str]] = {}
        for tensor in _expert_and_router_tensors(model):
            if tensor.name in index:
                continue
            parts = sorted(self._reverted(tensor.name, torch.empty(tensor.shape, device="meta")))
            if parts and all(part in index for part in parts):
                self.fused[tensor.name] = tensor
                self._parts[tensor.name] = parts
        self.owner_of = {part: name for name, parts in self._parts.items() for part in parts}
        """stored name -> the fused tensor it is part of."""

    def parts(self, name: str) -> list[str]:
        """The stored tensors that together hold the fused tensor `name`, sorted."""
        return self._parts[name]

    def _reverted(self, name: str, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """transformers' reverse conversion of one fused tensor: stored name -> its share of `values`."""
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(self._model, {name: values})  # type: ignore[arg-type]  # any nn.Module with a config
        return {part: value for part, value in reverted.items() if part != name}

    def _positions(self, name: str) -> dict[str, torch.Tensor]:
        """stored name -> the flat positions in fused tensor `name` of its elements, in its own shape: int32
        where they fit (4 bytes per element: a 30B MoE's fused tensor is half a GB of positions even so)."""
        shape = self.fused[name].shape
        numel = int(torch.Size(shape).numel())
        dtype = torch.int32 if numel < 2**31 else torch.int64
        return self._reverted(name, torch.arange(numel, dtype=dtype).reshape(shape))

    def read(self, name: str, read_part, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """Fused tensor `name` assembled from its stored parts (`read_part(stored name)` reads one) in `dtype`."""
        tensor = self.fused[name]
        flat = torch.empty(int(torch.Size(tensor.shape).numel()), dtype=dtype, device=device)
        for part, positions in self._positions(name).items():
            flat[positions.flatten().to(flat.device)] = read_part(part).to(device=flat.device, dtype=dtype).flatten()
        return flat.reshape(tensor.shape)

    def split(self, name: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fused tensor `name`'s values as the checkpoint stores them: stored name -> tensor."""
        flat = fused.flatten()
        return {
            part: flat[positions.flatten().to(flat.device)].reshape(positions.shape).contiguous()
            for part, positions in self._positions(name).items()
        }


def _expert_and_router_tensors(model: torch.nn.Module) -> list[ExpertTensor]:
    """The fused expert tensors and the routers' weights: the conversion renames both (Mixtral's
    `mlp.gate.weight` is stored as `block_sparse_moe.gate.weight`), and LoRA can reach both."""
    experts = expert_tensors(model)
    found = list(experts)
    for name in routers(model, experts):
        weight = unwrapped(model.get_submodule(name)).weight
        assert isinstance(weight, torch.Tensor), f"{name} holds a weight"
        found.append(ExpertTensor(name, "weight", tuple(getattr(weight, "ds_shape", weight.shape)), False))
    return found
