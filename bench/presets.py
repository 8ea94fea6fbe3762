"""GPU presets of bench/train_throughput.py: real-size Llama shapes with random weights, and the plan beside them.

A preset is a named set of train_throughput flags (its command line stays the one source of what runs):
the shape of a catalog base read from the architecture numbers shipped in `finetune/plan/configs/` (no
download: the weights are random, which changes neither speed nor memory), LoRA r=16 all-linear at
2048-token rows, bf16. `--smoke` shrinks the shape (and the rows, steps and vocabulary) so that every
code path of a preset, the 4-bit one included, runs on a CPU (about a minute per preset on 2 cores):
a check that the command works, not a measurement.

The model's vocabulary is the base's (128,256 for Llama 3), whatever the tokenizer the bench trains
knows (8,192 pieces): token ids only need to be below it. The head is computed over all 128,256 logits,
and `bench/flops.py` counts it at that size because it reads the saved model's config.

Example:
    python bench/train_throughput.py --preset llama-3.1-8b-qlora          # on a GPU
    python bench/train_throughput.py --preset llama-3.1-8b-qlora --smoke  # shrunken, anywhere
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SEQ_LEN = 2048


@dataclass(frozen=True)
class Preset:
    """One realistic LoRA run; every field becomes a train_throughput flag's default."""

    base_config: str
    """Hub id of a catalog base whose config ships in finetune/plan/configs/ (the shape, not the weights)."""
    quantization: str
    """`none` (a bf16 base) or `4bit` (nf4 with double quantization: QLoRA)."""
    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    steps: int
    warmup_steps: int
    description: str


PRESETS: dict[str, Preset] = {
    "llama-3.2-1b-lora": Preset(
        base_config="meta-llama/Llama-3.2-1B",
        quantization="none",
        micro_batch_size=4,  # finetune plan: 17.47 GiB (activations 14.6); measured 17.55 compiled on an H100
        grad_accum=2,
        gradient_checkpointing=False,
        steps=12,
        warmup_steps=2,
        description="Llama-3.2-1B-shaped base (1.24B, 128k vocabulary), bf16 LoRA r=16 all-linear, 4 x 2048 tokens",
    ),
    "llama-3.1-8b-qlora": Preset(
        base_config="meta-llama/Llama-3.1-8B",
        quantization="4bit",
        micro_batch_size=2,  # plan 7.36 GiB less the runtime (bf16 kept); 12.04 measured with the float32 upcast, an H100
        grad_accum=4,
        gradient_checkpointing=True,
        steps=10,
        warmup_steps=2,
        description="Llama-3.1-8B-shaped base (8.03B, 128k vocabulary), nf4 QLoRA r=16 all-linear, gradient "
        "checkpointing, 2 x 2048 tokens",
    ),
}

SMOKE_SHAPE = dict(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=2048,
)
"""Shrunken shape for `--smoke`: Llama 3's 4:1 grouped-query heads of 32 dims, and every quantized
layer's out_features a multiple of 32 (hidden 128, k/v 32, intermediate 448), which bitsandbytes' CPU
4-bit forward requires in eval mode. The vocabulary stays larger than the tokenizer's, as in the presets."""
SMOKE = dict(seq_len=256, steps=3, warmup_steps=1, vocab=1024, validation_records=4, repeats=1)


def flag_defaults(preset: Preset, smoke: bool) -> dict[str, Any]:
    """Defaults of train_throughput's flags for `preset` (explicit flags still override them)."""
    defaults: dict[str, Any] = dict(
        base_config=preset.base_config,
        quantization=preset.quantization,
        model_dtype="bfloat16",
        precision="bf16",
        micro_batch_size=preset.micro_batch_size,
        grad_accum=preset.grad_accum,
        gradient_checkpointing=preset.gradient_checkpointing,
        steps=preset.steps,
        warmup_steps=preset.warmup_steps,
        seq_len=SEQ_LEN,
        long_records=True,  # rows of ~2048 tokens: the shape `finetune plan` estimates
        lr=2e-4,
        validation_records=8,
        heldout_batch_size=preset.micro_batch_size,
        no_own_eval=True,  # evaluations outside the timed steps would only add GPU time and a later peak
        # rows this long leave nothing to pack: ours padded would repeat ours packed; the Trainer with Liger
        # Kernel runs where liger-kernel is installed (skipped, saying why, elsewhere)
        arms="ours-packed,hf-trainer,hf-trainer-liger",
        repeats=2,
    )
    if smoke:
        defaults.update(SMOKE)
    # No more than the steps need (train_throughput adds its margin): ~2048-token records are slow to make.
    defaults["records"] = defaults["steps"] * preset.micro_batch_size * preset.grad_accum
    return defaults


def base_config(hub_id: str, smoke: bool, tokenizer: Any, max_positions: int) -> Any:
    """The `LlamaConfig` of a catalog base from its shipped numbers, with the tokenizer's special ids
    (below any vocabulary size), shrunken with `smoke`."""
    from finetune.plan.model_config import SHIPPED_CONFIGS, config_from_json

    config = config_from_json(SHIPPED_CONFIGS / f"{hub_id}.json")
    for key, value in (SMOKE_SHAPE if smoke else {}).items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.max_position_embeddings = max(max_positions, 2048)
    assert config.vocab_size >= len(tokenizer), "the model needs an embedding row for every token id"
    return config


def build_random_base(config: Any, out_dir: Path, *, device: str, dtype: str, seed: int) -> dict[str, Any]:
    """A `*ForCausalLM` of `config` with random weights, built on `device` in `dtype` (on a GPU its random
    initialisation runs there, not on the host), saved with `save_pretrained` and freed."""
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            if device != "cpu":
                torch.cuda.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default_dtype)
    built = time.perf_counter()
    model.save_pretrained(out_dir)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"parameters": parameters, "build_seconds": built - started, "save_seconds": time.perf_counter() - built}


def plan_figures(recipe: Any, device: Literal["cpu", "cuda"]) -> dict[str, Any]:
    """`finetune plan`'s estimate for `recipe` (the very recipe ours trains with) on one `device`.

    `comparable_bytes` leaves out the plan's runtime part (on a GPU the CUDA context, which
    `torch.cuda.max_memory_allocated` does not see), so it can be set beside that measured peak. On a GPU at hand
    the plan knows its memory, as the run does, so `gradient_checkpointing: auto` resolves alike in both.
    """
    import torch

    from finetune.plan.memory import estimate
    from finetune.plan.model_config import find_model_config
    from finetune.plan.shape import model_shape
    from finetune.training.checkpointing import device_memory_bytes

    config, _ = find_model_config(recipe.model.base)
    device_bytes = device_memory_bytes(torch.device("cuda")) if device == "cuda" and torch.cuda.is_available() else None
    plan = estimate(recipe, model_shape(config, recipe.lora), device=device, device_bytes=device_bytes)
    runtime = sum(part.num_bytes for part in plan.parts if part.name == "runtime")
    return {
        "device": device,
        "peak_bytes": plan.peak_bytes,
        "runtime_bytes": runtime,
        "comparable_bytes": plan.peak_bytes - runtime,
        "checkpointed_layers": plan.checkpointed_layers,
        "parts": plan.as_json()["parts"],
    }


def plan_over_measured(plan_bytes: int | None, measured_bytes: int | None) -> float | None:
    """The plan's estimate over a measured peak (1.0: exact; above: the plan is on the safe side)."""
    if not plan_bytes or not measured_bytes:
        return None
    return plan_bytes / measured_bytes
