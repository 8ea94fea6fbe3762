"""Does an adapter fit a base? The same checks for a model in memory and a checkpoint on disk.

`check_fingerprint`: the adapter was trained on this base (its manifest's weight fingerprint), unless the
user forces it. `check_fits`: each targeted module must exist in the base, be a layer a LoRA update can be added to (linear or
embedding), and have the shape the update has; the first module that does not is named, with what it
most likely means (another architecture, another size). `bind_layouts`: each linear update is laid out as the
base's layer stores its weight (transformers' `Conv1D` (in, out), `nn.Linear` (out, in)), as peft decides it.

Example:
    adapter = bind_layouts(adapter, model)
    check_fits(adapter, lambda module: shapes[module + ".weight"], base="models/tiny")
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from finetune.adapters.lora import Adapter
from finetune.errors import AdapterError, AdapterWarning

ShapeOf = Callable[[str], "tuple[int, ...] | str"]
"""module -> the shape of its weight, or a word for what it is when no update can be added (e.g. 'Conv2d');
raises KeyError when the base has no such module."""


def check_fits(adapter: Adapter, shape_of: ShapeOf, base: str) -> None:
    """Raise `AdapterError` naming the first module of `adapter` that `base` does not have as it expects."""
    for module, lora in sorted(adapter.modules.items()):
        try:
            shape = shape_of(module)
        except KeyError:
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.path}) targets {module}, which the base {base} does not have: it "
                "was trained on another architecture"
            ) from None
        if isinstance(shape, str):
            raise AdapterError(
                f"adapter {adapter.name!r}: {module} is a {shape} in {base}, not a linear or embedding layer"
            )
        if tuple(shape) != tuple(lora.weight_shape):
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.path}): {module} is {tuple(shape)} in {base} but the update is "
                f"{lora.weight_shape}: the adapter was trained on another base size"
            )


def check_fingerprint(adapter: Adapter, base_fingerprint: str | None, base_where: str, *, force: bool) -> None:
    """Refuse an adapter trained on another base (unless `force`); warn when no check is possible."""
    if adapter.base_fingerprint is None or not adapter.base_fingerprint.startswith("sha256:"):
        why = "has no manifest.json" if adapter.base_fingerprint is None else "records no base fingerprint"
        warnings.warn(
            f"adapter {adapter.name!r} ({adapter.path}) {why}, so whether it was trained on {base_where} "
            "cannot be checked",
            AdapterWarning,
            stacklevel=3,
        )
        return
    if base_fingerprint is None or adapter.base_fingerprint == base_fingerprint:
        return
    assert adapter.manifest is not None  # it holds the base fingerprint
    message = (
        f"adapter {adapter.name!r} ({adapter.path}) was trained on base {adapter.manifest.base.path} "
        f"({adapter.base_fingerprint}) but {base_where} is {base_fingerprint}"
    )
    if not force:
        raise AdapterError(message + "; use the right base or pass --force (force=True)")
    warnings.warn(f"{message}; applied anyway (--force)", AdapterWarning, stacklevel=3)


def bind_layouts(adapter: Adapter, model: torch.nn.Module) -> Adapter:
    """`adapter` with each linear module's `fan_in_fan_out` taken from the layer of `model` it targets.

    peft holds LoRA on a `Conv1D` (GPT-2's attention and MLP) and on an `nn.Linear` alike, A (r, in) and
    B (out, r), and transposes the update for `Conv1D` only. It decides that per layer whenever it wraps one,
    whatever `adapter_config.json` says, and on the way rewrites the config's flag to the kind of the last
    layer it wrapped: an adapter on GPT-2's `c_attn` and `lm_head` is saved with `fan_in_fan_out: false`.
    The config's flag stays for modules `model` lacks (`check_fits` names them); embeddings and expert
    tensors have layouts of their own.
    """
    modules = dict(adapter.modules)
    for module, lora in adapter.modules.items():
        if lora.embedding or lora.num_experts > 1:
            continue
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            continue
        while isinstance(wrapped := getattr(layer, "base_layer", None), torch.nn.Module):  # peft's LoRA wrapper
            layer = wrapped
        if type(layer).__name__ == "Conv1D" or isinstance(layer, torch.nn.Linear):
            modules[module] = replace(lora, fan_in_fan_out=type(layer).__name__ == "Conv1D")
    return replace(adapter, modules=modules)
