"""Tiny random bases of four mixture-of-experts families and seeded adapters on them, for the MoE tests.

Example:
    base_dir = build_moe("qwen3_moe", tmp_path / "base", tiny_tokenizer)
    adapter_dir = moe_adapter(base_dir, tmp_path / "a", seed=1)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
)

from finetune.model import wrap_with_lora
from finetune.recipe import LoraConfig

MOE_SHAPE = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, num_experts_per_tok=2,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**MOE_SHAPE, moe_intermediate_size=32, num_experts=4),
    "mixtral": lambda: MixtralConfig(**MOE_SHAPE, intermediate_size=32, num_local_experts=4),
    "olmoe": lambda: OlmoeConfig(**MOE_SHAPE, intermediate_size=32, num_experts=4),
    "gpt_oss": lambda: GptOssConfig(**MOE_SHAPE, intermediate_size=32, num_local_experts=4, head_dim=16),
}
"""Tiny configurations of the real classes: 2 layers of 4 experts, top-2 routing."""
MORE_FAMILIES = {
    # a dense first layer and a shared expert, MLPs named as plain peft renames onto the experts on load; MLA
    # attention, which has as many key/value heads as heads
    "deepseek_v3": lambda: DeepseekV3Config(
        **{**MOE_SHAPE, "num_key_value_heads": 4},
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),  # fmt: skip
    # linear attention (a 3D depthwise conv1d weight, which is no expert tensor) beside full attention
    "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(
        **MOE_SHAPE,
        head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),  # fmt: skip
}
"""Families with more than routed experts, for the tests that need them (not in every MoE test's loop)."""


def build_moe(family: str, out: Path, tokenizer, seed: int = 0, **overrides) -> Path:
    """A random-init tiny base of `family`, saved with its tokenizer as transformers saves it."""
    torch.manual_seed(seed)
    config = {**FAMILIES, **MORE_FAMILIES}[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config.pad_token_id, config.bos_token_id, config.eos_token_id = (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def moe_adapter(
    base_dir: Path, out: Path, seed: int, r: int = 4, *, linear: bool = True, train_router: bool = False
) -> Path:
    """A seeded random LoRA on every linear layer and expert tensor of `base_dir`, as `finetune train` targets
    (and on the routers with `train_router`).

    `linear=False`: the linear layers' LoRA has B = 0 (their update is exactly zero, merged or not), so only
    the experts (and routers) change the model.
    """
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = wrap_with_lora(model, LoraConfig(r=r, alpha=2 * r, dropout=0.0, train_router=train_router))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
        for module in peft_model.modules():
            if not linear and hasattr(module, "lora_B") and not hasattr(module, "parameter_name"):
                module.lora_B["default"].weight.zero_()  # a linear layer's LoRA, not a ParamWrapper's
    peft_model.save_pretrained(out)
    return out


def merged_logits(m, names: list[str | None], ids: torch.Tensor) -> dict[str | None, torch.Tensor]:
    """name -> the logits of `m` (a `finetune.LoadedModel`) with that adapter merged (None: the base), one
    forward each; `m` is left as it was."""
    out = {}
    for name in names:
        if name is not None:
            m.merge(name)
        with torch.no_grad():
            out[name] = m.model(input_ids=ids).logits
        if name is not None:
            m.subtract(name)
    return out
