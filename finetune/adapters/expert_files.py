"""Fused expert tensors in checkpoints that store one tensor per expert (and per projection).

transformers 5 fuses experts when it loads (`mlp.experts.gate_up_proj`, experts x 2i x d) and, for most
families (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-style), splits them back when it saves
(`mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`; Mixtral's router
`mlp.gate.weight` is renamed `block_sparse_moe.gate.weight` too, so routers are mapped the same way). Adapter arithmetic
works on the fused tensor, so this module maps one to the other with transformers' own reverse conversion
(`revert_weight_conversion`), applied once to a tensor whose values are their own flat positions: each
stored tensor then says exactly which elements of the fused one it holds, whatever renames, stacking and
concatenation the family's conversion does. No family is named here.

Where the conversion keeps each stored tensor inside one expert's slice of the fused tensor, as a strided view
of it (stacking, concatenation, transposes: every family transformers 5 ships), that view is worked out once
per fused tensor (`PartSlice`, from a few reversions of index tensors of 1-2 bytes per element) and the
fused tensor is read, split and merged one expert at a time (`read_expert`, `split_expert`), holding one
expert's slice. Otherwise whole-tensor position maps are used (4 bytes per element while one tensor is
assembled or split).

Example:
    layout = ExpertLayout(model, index)          # model: the architecture (meta device is enough)
    layout.parts("model.layers.0.mlp.experts.down_proj")   # ['model.layers.0.mlp.experts.0.down_proj.weight', ...]
    fused = layout.read("model.layers.0.mlp.experts.down_proj", torch.float32)
    stored = layout.split("model.layers.0.mlp.experts.down_proj", fused)   # stored name -> tensor
    layout.experts_apart("model.layers.0.mlp.experts.down_proj")   # True: each part lies in one expert's slice
    three = layout.read_expert("model.layers.0.mlp.experts.down_proj", 3, index.read, torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy
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
        self._slices: dict[str, dict[str, PartSlice] | None] = {}

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

    def experts_apart(self, name: str) -> bool:
        """Whether each stored part of fused tensor `name` lies in one expert's slice (then it can be read,
        split and merged expert by expert)."""
        return self._part_slices(name) is not None

    def read(
        self, name: str, read_part: ReadPart, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Fused tensor `name` assembled from its stored parts (`read_part(stored name)` reads one) in `dtype`."""
        tensor = self.fused[name]
        if self.experts_apart(name):
            fused = torch.empty(tensor.shape, dtype=dtype, device=device)
            for expert in range(tensor.num_experts):
                fused[expert] = self.read_expert(name, expert, read_part, dtype, device)
            return fused
        flat = torch.empty(int(torch.Size(tensor.shape).numel()), dtype=dtype, device=device)
        for part, positions in self._positions(name).items():
            flat[positions.flatten().to(flat.device)] = read_part(part).to(device=flat.device, dtype=dtype).flatten()
        return flat.reshape(tensor.shape)

    def split(self, name: str, fused: torch.Tensor) -> dict[str, torch.Tensor]:
        """Fused tensor `name`'s values as the checkpoint stores them: stored name -> tensor."""
        if self.experts_apart(name):
            return {
                part: values
                for expert in range(self.fused[name].num_experts)
                for part, values in self.split_expert(name, expert, fused[expert]).items()
            }
        flat = fused.flatten()
        return {
            part: flat[positions.flatten().to(flat.device)].reshape(positions.shape).contiguous()
            for part, positions in self._positions(name).items()
        }

    def expert_of(self, name: str, part: str) -> int:
        """The expert whose slice of fused tensor `name` stored tensor `part` lies in (`experts_apart`)."""
        slices = self._part_slices(name)
        assert slices is not None, f"{name}: its stored parts do not lie in one expert each"
        return slices[part].expert

    def read_expert(
        self, name: str, expert: int, read_part: ReadPart, dtype: torch.dtype, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Expert `expert`'s slice of fused tensor `name` (`experts_apart`), read from its stored parts only."""
        inner = self.fused[name].shape[1:]
        flat = torch.empty(int(torch.Size(inner).numel()), dtype=dtype, device=device)
        for part, where in self._expert_parts(name, expert):
            where.view_of(flat).copy_(read_part(part).to(device=flat.device, dtype=dtype))
        return flat.view(inner)

    def split_expert(self, name: str, expert: int, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Expert `expert`'s slice of fused tensor `name` (`values`, its inner shape) as its stored parts."""
        flat = values.contiguous().view(-1)
        return {part: where.view_of(flat).contiguous() for part, where in self._expert_parts(name, expert)}

    def _expert_parts(self, name: str, expert: int) -> list[tuple[str, PartSlice]]:
        slices = self._part_slices(name)
        assert slices is not None, f"{name}: its stored parts do not lie in one expert each"
        return [(part, where) for part, where in slices.items() if where.expert == expert]

    def _part_slices(self, name: str) -> dict[str, PartSlice] | None:
        """stored part -> where it lies in its expert's slice of fused tensor `name`; None where some part is
        not one strided view of one expert's slice (then whole-tensor position maps are used)."""
        if name not in self._slices:
            self._slices[name] = self._work_out_slices(name)
        return self._slices[name]

    def _work_out_slices(self, name: str) -> dict[str, PartSlice] | None:
        """Revert index tensors through the conversion: the expert of each element, then its index along each
        inner dimension (each a broadcast view, in the smallest integer type that holds it); every part must
        see one expert and indices affine in its own (a strided view), and each expert's parts must cover
        its slice exactly once."""
        shape = self.fused[name].shape
        experts, inner = shape[0], shape[1:]
        expert_of: dict[str, int] = {}
        for part, values in self._reverted(name, _index_along(0, shape)).items():
            affine = _affine(values, experts)
            if affine is None or any(affine[1]):
                return None
            expert_of[part] = affine[0]
        offsets = dict.fromkeys(expert_of, 0)
        strides = {part: [0] * len(self._index[part].shape) for part in expert_of}
        inner_strides = torch.empty(inner, device="meta").stride()
        for dim, inner_stride in enumerate(inner_strides):
            for part, values in self._reverted(name, _index_along(dim + 1, shape)).items():
                affine = _affine(values, inner[dim])
                if affine is None:
                    return None
                offsets[part] += affine[0] * inner_stride
                strides[part] = [total + step * inner_stride for total, step in zip(strides[part], affine[1])]
        slices = {
            part: PartSlice(expert_of[part], offsets[part], tuple(self._index[part].shape), tuple(strides[part]))
            for part in expert_of
        }
        return slices if _cover_each_expert_once(slices, experts, int(torch.Size(inner).numel())) else None


ReadPart = Callable[[str], torch.Tensor]
"""Reads one stored tensor by name."""


@dataclass(frozen=True)
class PartSlice:
    """Where a stored tensor lies in its expert's slice of a fused tensor: the strided view
    (`size`, `stride`, `offset`) of that slice's contiguous elements."""

    expert: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This part's view of `flat`, the expert's slice flattened (contiguous)."""
        return flat.as_strided(self.size, self.stride, flat.storage_offset() + self.offset)


def _index_along(dim: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` whose every element holds its index along `dim`: a broadcast view of one arange, in
    the smallest integer type that holds the largest index (so a reversion that copies stays small)."""
    size = shape[dim]
    dtype = torch.uint8 if size <= 2**8 else torch.int16 if size <= 2**15 else torch.int32
    view = [1] * len(shape)
    view[dim] = size
    return torch.arange(size, dtype=torch.int32).to(dtype).view(view).expand(shape)


def _affine(values: torch.Tensor, bound: int) -> tuple[int, list[int]] | None:
    """(first, step along each dimension) when `values`, indices below `bound`, are those a strided view of
    `arange(bound)` holds (first + Σ index·step, steps ≥ 0), else None. Checked by one comparison with that
    view, in `values`' own small integer type: no copy."""
    origin = (0,) * values.dim()
    first = int(values[origin])
    steps = []
    for dim, size in enumerate(values.shape):
        steps.append(int(values[origin[:dim] + (1,) + origin[dim + 1 :]]) - first if size > 1 else 0)
    last = first + sum((size - 1) * step for size, step in zip(values.shape, steps))
    if min(steps, default=0) < 0 or last >= bound:
        return None
    expected = torch.arange(bound, dtype=torch.int32).to(values.dtype).as_strided(values.shape, steps, first)
    # numpy compares strided small integers about 25x faster than torch.equal on 2 Xeon cores
    return (first, steps) if numpy.array_equal(values.numpy(), expected.numpy()) else None


def _cover_each_expert_once(slices: Mapping[str, PartSlice], experts: int, numel: int) -> bool:
    """Whether each expert's parts cover its slice (`numel` elements) exactly once. Counted for the first expert;
    the others need the same layout (offsets, sizes, strides), as every family has."""
    layouts = [sorted((w.offset, w.size, w.stride) for w in slices.values() if w.expert == e) for e in range(experts)]
    if any(layout != layouts[0] for layout in layouts[1:]):
        return False
    covered = torch.zeros(numel, dtype=torch.uint8)
    for offset, size, stride in layouts[0]:
        PartSlice(0, offset, size, stride).view_of(covered).add_(1)
    return bool((covered == 1).all())


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
