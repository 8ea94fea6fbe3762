"""Helpers for adapter tests: real peft adapters with random (non-zero) A and B, written with save_pretrained.

Example:
    make_adapter(tiny_base_dir, tmp_path / "legal", seed=1, targets=("q_proj", "v_proj"))
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from finetune.fingerprint import fingerprint_model_dir
from finetune.manifest import BaseInfo, Manifest, write_manifest

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    base_dir: Path,
    out: Path,
    *,
    seed: int,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    r: int = 4,
    alpha: float = 8,
    use_rslora: bool = False,
    manifest: bool = True,
    name: str | None = None,
    magnitude: float = 0.2,
    quantization: str = "none",
    **lora_options,
) -> Path:
    """A peft LoRA adapter for `base_dir` with seeded random A, B (so ΔW ≠ 0), optionally with a manifest."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora, lora_dropout=0.0, **lora_options
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter_name, parameter in peft_model.named_parameters():
            if "lora_" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * magnitude)
    peft_model.save_pretrained(out)
    if manifest:
        base = BaseInfo(
            id=str(base_dir), path=str(base_dir), fingerprint=fingerprint_model_dir(base_dir), quantization=quantization
        )
        write_manifest(out, Manifest(name=name or out.name, base=base))
    return out


def base_tensors(model) -> dict[str, torch.Tensor]:
    """A detached copy of every tensor in a model's state dict."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_tensors_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equality of two state dicts, naming the first tensor that differs."""
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), (
            f"{name} differs: max |Δ| {(expected[name].float() - actual[name].float()).abs().max():.3e}"
        )


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory, tiny_base_dir) -> dict[str, Path]:
    """Three adapters on the tiny base with overlapping targets, one rsLoRA, one with another rank and alpha."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "legal": make_adapter(tiny_base_dir, root / "legal", seed=1, targets=("q_proj", "v_proj")),
        "med": make_adapter(
            tiny_base_dir, root / "med", seed=2, targets=("q_proj", "o_proj", "down_proj"), r=8, alpha=16
        ),
        "code": make_adapter(
            tiny_base_dir, root / "code", seed=3, targets=("v_proj", "up_proj"), r=2, alpha=4, use_rslora=True
        ),
    }
