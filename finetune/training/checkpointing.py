"""`train.gradient_checkpointing` on a loaded model: which decoder layers recompute their activations in the
backward, with `auto` resolved against the device's memory by `finetune plan`'s estimate.

A checkpointed layer keeps only its input and runs its forward again in the backward. That is about a third
more matmul work for the layer, and on a 4-bit base one more dequantization of each of its weights. Checkpointing
every layer is the usual advice for QLoRA. It is what an 8B model needs on a 24 GB card, but it is not what an
80 GB card needs: `finetune plan` puts the 8B QLoRA preset (2 x 2048 tokens) at 7.9 GiB with every layer
checkpointed and 30.7 GiB with none. `auto` checkpoints the fewest layers with which the plan fits in the memory
this process can have (`finetune.plan.memory.estimate`, `device_memory_bytes`). That is 13 of 32 layers on an
otherwise empty 24 GiB card and none on 80 GiB.

The checkpointed layers are the first ones. Their backward runs last, after the activations the later layers
kept have been freed, so the peak is the larger of those activations and one recomputed layer. transformers
checkpoints a layer where its `gradient_checkpointing` flag is set (`GradientCheckpointingLayer`). peft's
`gradient_checkpointing_enable` sets the flag on every layer, and the layers after the first N are then turned
back off. torch's checkpoint restores the RNG state when it recomputes, so dropout draws the same masks: the
step computes the same result whichever layers are checkpointed.

Example:
    layers = checkpointed_layer_count(recipe, model.config, device, nproc=1)
    enable_checkpointing(peft_model, layers)
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from finetune.errors import RecipeError
from finetune.model import decoder_layers
from finetune.plan.memory import estimate
from finetune.plan.shape import model_shape
from finetune.recipe import Recipe


def checkpointed_layer_count(recipe: Recipe, config: Any, device: torch.device, nproc: int) -> int:
    """How many decoder layers the run checkpoints: `gradient_checkpointing` as set, `auto` against the memory of
    `device` (`device_memory_bytes`) for `nproc` processes."""
    setting = recipe.train.gradient_checkpointing
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = int(text_config.num_hidden_layers)
    if setting != "auto":
        return recipe.train.checkpointed_layers(num_layers)
    device_type: Literal["cpu", "cuda"] = "cuda" if device.type == "cuda" else "cpu"
    shape = model_shape(config, recipe.lora)
    return estimate(
        recipe, shape, device=device_type, nproc=nproc, device_bytes=device_memory_bytes(device)
    ).checkpointed_layers


def device_memory_bytes(device: torch.device) -> int:
    """The memory `auto` plans against: what this process can have of the device. That is the free memory plus
    what the process already holds (the base it has loaded, which the plan counts): on a GPU, torch's reserved
    memory; on a CPU, the host's available memory and the process's resident set. A GPU's total memory would
    also count what another process on it holds (a notebook's kernel, a server), and `auto` would then plan
    fewer checkpointed layers than fit."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    import psutil  # accelerate's dependency

    return int(psutil.virtual_memory().available + psutil.Process().memory_info().rss)


def enable_checkpointing(peft_model: Any, layers: int) -> None:
    """Checkpoint the first `layers` decoder layers of `peft_model` (none: checkpointing stays off)."""
    if layers == 0:
        return
    all_layers = decoder_layers(peft_model)
    if layers < len(all_layers) and not all(isinstance(layer, GradientCheckpointingLayer) for layer in all_layers):
        raise RecipeError(
            f"train.gradient_checkpointing {layers}: {type(all_layers[0]).__name__} cannot be checkpointed layer by "
            f"layer (not a transformers GradientCheckpointingLayer); set true (all {len(all_layers)} layers) or false"
        )
    peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in all_layers[layers:]:
        setattr(layer, "gradient_checkpointing", False)  # noqa: B010  # torch types module attributes as Tensor | Module
