"""Requantize a merged 16/32-bit checkpoint to bitsandbytes 4-bit or 8-bit, measuring the error it adds.

Merging into a quantized base always produces dense weights first (`ondisk`); this is the optional
second step (`finetune adapters merge ... --requantize`). The model is loaded with transformers'
bitsandbytes integration (the way training loaded the base), every quantized layer's dequantized weight
is compared with the dense merged weight, and the quantized model is saved with `save_pretrained`.
Requantized checkpoints are for inference: on-disk arithmetic refuses them as input.

Example:
    errors = requantize_checkpoint(Path("merged/legal"), Path("merged/legal-nf4"), "4bit", {})
    max(errors.values())   # relative Frobenius error of the worst layer, e.g. 0.09 for nf4
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from finetune.adapters.ledger import LEDGER_KEY
from finetune.adapters.model_dir import copy_side_files, staging_dir
from finetune.adapters.tensor_index import TensorIndex
from finetune.errors import AdapterError


def requantize_checkpoint(dense_dir: Path, out: Path, quantization: str, options: dict) -> dict[str, float]:
    """Write `dense_dir` quantized to `out`; returns module -> ‖deq(q(W)) − W‖_F / ‖W‖_F."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.adapters.quantized import dequantize, is_quantized_linear

    if quantization == "8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    elif quantization == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=options.get("bnb_4bit_quant_type", "nf4"),
            bnb_4bit_use_double_quant=options.get("bnb_4bit_use_double_quant", True),
            bnb_4bit_compute_dtype=torch.float32,
        )
    else:
        raise AdapterError("--requantize needs adapters trained on a 4bit or 8bit base (or --quantization 4bit|8bit)")
    model = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=config, dtype=torch.float32)
    dense = TensorIndex.of(dense_dir)
    errors: dict[str, float] = {}
    for name, module in model.named_modules():
        if is_quantized_linear(module):
            exact = dense.read(name + ".weight").to(torch.float32)
            errors[name] = float((dequantize(module) - exact).norm() / exact.norm().clamp_min(1e-30))
    ledger = json.loads((dense_dir / "config.json").read_text())[LEDGER_KEY]
    model.config.update({LEDGER_KEY: ledger})
    with staging_dir(out) as tmp:
        copy_side_files(dense_dir, tmp)
        model.save_pretrained(tmp)
    return errors
