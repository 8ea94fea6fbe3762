"""PiSSA and OLoRA adapters written as plain LoRA on the base as it is on disk.

`lora.init: pissa | olora` starts the adapter from the base's principal (or QR) components and takes them out of
the base the run trains on: W_res = W − s·B₀A₀. The trained model is W_res + s·B·A, so its update over the base
on disk is ΔW = s·(B·A − B₀·A₀): a LoRA of rank 2r with A' = [A; A₀] and B' = [B, −B₀], the scale kept by
doubling alpha (×√2 with rsLoRA, whose scale is alpha/√r). That is peft's own conversion
(`save_pretrained(path_initial_model_for_weight_conversion=...)`), done here on the tensors. Written as the
trained A and B alone, the adapter was read by everything but peft's loader (finetune's merge, `generate`, GGUF
export) as an update of W, not of W_res: another model.

LoRA on the input embeddings (`lora.train_embed_tokens`) is no part of that: peft starts an embedding's LoRA as it
always does (A = 0) and leaves its base weight as it is, so its update is s·B·A already. It is padded to rank 2r
with zeros, the rank the written config gives every module: left at r, every reader of the adapter refused it
("lora_A has rank 4 but adapter_config.json says r=8"), peft's loader with a size mismatch.

The start (A₀, B₀) is kept in the run directory when the adapter is created, so a resumed run converts with it.

Example:
    keep_start(recipe, peft_model)                      # after wrapping, before training
    weights = as_plain_lora(recipe, weights)            # at the end, before peft writes them
    plain_lora_config(recipe, staging / "adapter_config.json")
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from finetune.atomic import atomic_file
from finetune.recipe import Recipe
from finetune.training.run_files import START_FILE

MUTATING_INITS = ("pissa", "olora")


def mutates_base(recipe: Recipe) -> bool:
    return recipe.lora.init in MUTATING_INITS


def keep_start(recipe: Recipe, peft_model: Any) -> None:
    """Write the adapter's starting factors (A₀, B₀) into the run directory, once: every process computes the
    same ones, and a resumed run finds them there."""
    path = recipe.output.run_path / START_FILE
    if not mutates_base(recipe) or path.exists():
        return
    start = {name: p.detach().to("cpu", copy=True).contiguous() for name, p in peft_model.named_parameters()
             if p.requires_grad}  # fmt: skip
    with atomic_file(path) as staging:
        save_file(start, str(staging))


def as_plain_lora(recipe: Recipe, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained LoRA weights as an update of the base on disk (see the module docstring); as they are for an
    adapter that started as a plain LoRA."""
    if not mutates_base(recipe):
        return weights
    start = load_file(str(recipe.output.run_path / START_FILE))
    plain = dict(weights)
    for name, tensor in weights.items():
        if ".lora_A." in name:
            plain[name] = torch.cat([tensor, start[name].to(tensor.dtype)], dim=0)
        elif ".lora_B." in name:
            plain[name] = torch.cat([tensor, -start[name].to(tensor.dtype)], dim=1)
        elif ".lora_embedding_A." in name:  # (r, vocab): an embedding's base was not rewritten, see above
            plain[name] = torch.cat([tensor, torch.zeros_like(tensor)], dim=0)
        elif ".lora_embedding_B." in name:  # (dim, r)
            plain[name] = torch.cat([tensor, torch.zeros_like(tensor)], dim=1)
    return plain


def plain_lora_config(recipe: Recipe, config_file: Path) -> None:
    """The written adapter_config.json for the plain LoRA of rank 2r that `as_plain_lora` made, as peft writes it.
    (A recipe sets no rank or alpha patterns, so r and alpha are all there is to double.)"""
    if not mutates_base(recipe):
        return
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["r"] *= 2
    config["lora_alpha"] *= math.sqrt(2) if config.get("use_rslora") else 2
    config["init_lora_weights"] = True
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
