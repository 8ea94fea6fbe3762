"""Requantize a merged 16/32-bit checkpoint to bitsandbytes 4-bit or 8-bit, measuring the error it adds.

Merging into a quantized base always produces dense weights first (`ondisk`); this is the optional
second step (`finetune adapters merge ... --requantize`). The model is loaded with transformers'
bitsandbytes integration (the way training loaded the base), every quantized layer's dequantized weight
is compared with the dense merged weight, and the quantized model is saved with `save_pretrained`.
Requantized checkpoints are for inference: on-disk arithmetic refuses them as input.

Example:
    errors = requantize_checkpoint(Path("merged/legal"), Path("merged/legal-nf4"), Quantization("4bit"), device)
    max(errors.values())   # relative Frobenius error of the worst layer, e.g. 0.09 for nf4
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from finetune.adapters.ledger import LEDGER_KEY
from finetune.adapters.model_dir import copy_side_files, staging_dir
from finetune.adapters.quantized import dequantize, is_quantized_linear
from finetune.adapters.tensor_index import TensorIndex
from finetune.errors import AdapterError
from finetune.quantization import Quantization


def requantize_checkpoint(
    dense_dir: Path, out: Path, quantization: Quantization, device: torch.device
) -> dict[str, float]:
    """Write `dense_dir` quantized to `out` (quantized on `device`, as a base is loaded there); returns
    module -> ‖deq(q(W)) − W‖_F / ‖W‖_F."""
    config = quantization.bnb_config(compute_dtype=torch.float32)
    if config is None:
        raise AdapterError("--requantize needs adapters trained on a 4bit or 8bit base (or --quantization 4bit|8bit)")
    placement = {"device_map": {"": device}} if device.type != "cpu" else {}
    model = AutoModelForCausalLM.from_pretrained(
        dense_dir, quantization_config=config, dtype=torch.float32, **placement
    )
    dense = TensorIndex.of(dense_dir)
    errors: dict[str, float] = {}
    for name, module in model.named_modules():
        if is_quantized_linear(module):
            exact = dense.read(name + ".weight").to(device=device, dtype=torch.float32)
            errors[name] = float((dequantize(module) - exact).norm() / exact.norm().clamp_min(1e-30))
    ledger = json.loads((dense_dir / "config.json").read_text())[LEDGER_KEY]
    model.config.update({LEDGER_KEY: ledger})
    with staging_dir(out) as tmp:
        copy_side_files(dense_dir, tmp)
        model.save_pretrained(tmp)
    return errors
