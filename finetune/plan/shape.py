"""Count a model's parameters exactly from its config, on the meta device: no weights, no memory.

The model is built with `AutoModelForCausalLM.from_config` under `torch.device("meta")` (tensors with
shapes and no storage) and wrapped with LoRA by the same `finetune.model.wrap_with_lora` that training
uses, so `target_modules` (`all-linear`, lists, regexes), `exclude_modules`, `train_lm_head`,
`train_embed_tokens` and DoRA resolve exactly as in a real run.

Example:
    shape = model_shape(config, recipe.lora)
    shape.lora_params   # 19,660,800 for Llama 3.1 8B, r=8 on q/v/o/gate/up/down
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from finetune.errors import ModelError
from finetune.model import decoder_layers, wrap_with_lora
from finetune.recipe import LoraConfig


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, counted from one meta-device model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    quantizable_params: int
    """Weights of the linear layers inside the decoder layers: what bitsandbytes quantizes."""
    other_params: int
    """Everything else (embeddings, an untied output head, norms, biases), counted once when tied."""
    layer_params: int
    """One decoder layer: what FSDP gathers at a time."""
    lora_params: int
    """Trainable LoRA parameters (A, B and DoRA magnitudes) as peft creates them."""

    @property
    def base_params(self) -> int:
        return self.quantizable_params + self.other_params


def _unique_numel(parameters: Any) -> int:
    """Parameter count with tied tensors counted once."""
    return sum(p.numel() for p in {id(p): p for p in parameters}.values())


def model_shape(config: Any, lora: LoraConfig) -> ModelShape:
    """Build `config`'s model on the meta device, wrap it as training would, and count."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(model)
    if not layers:
        raise ModelError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); cannot plan it")
    quantizable = sum(
        module.weight.numel() for layer in layers for module in layer.modules() if isinstance(module, torch.nn.Linear)
    )
    total = _unique_numel(model.parameters())
    layer_params = max(_unique_numel(layer.parameters()) for layer in layers)
    peft_model = wrap_with_lora(model, lora)
    lora_params = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape(
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        num_layers=len(layers),
        num_heads=text.num_attention_heads,
        vocab_size=text.vocab_size,
        quantizable_params=quantizable,
        other_params=total - quantizable,
        layer_params=layer_params,
        lora_params=lora_params,
    )
