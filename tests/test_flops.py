"""bench.flops against torch's own count of the matmuls a LoRA training step runs.

`torch.utils.flop_counter.FlopCounterMode` counts every mm/bmm autograd actually executes, forward and
backward. Eager attention computes each row's full n x n scores with plain matmuls, so one document
per row (no padding) is exactly what the formula counts; the formula must then agree to the FLOP,
whichever projections carry LoRA (the first layer's skipped input gradients depend on that).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from bench.flops import ALL_LINEAR, DecoderShape, step_flops

# Grouped-query attention and a head_dim that is not hidden / heads, so a formula that confuses
# hidden_size with heads x head_dim, or K/V width with Q's, is off.
CONFIG = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    intermediate_size=40,
    vocab_size=96,
    tie_word_embeddings=False,
)
RANK = 4


def counted_flops(targets: tuple[str, ...], batches: list[tuple[int, int]]) -> int:
    """FLOPs torch counts for forward + backward of a LoRA model on (rows, length) batches."""
    config = LlamaConfig(**CONFIG, attn_implementation="eager")
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    base.set_attn_implementation("eager")  # whatever a build prefers: SDPA's own FLOP formula counts otherwise
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=8, lora_dropout=0.1, target_modules=list(targets)))
    model.train()
    counter = FlopCounterMode(display=False)
    with counter:
        for rows, length in batches:
            input_ids = torch.randint(0, CONFIG["vocab_size"], (rows, length))
            model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    operators = {str(op) for op in counter.get_flop_counts()["Global"]}
    assert operators <= {"aten.mm", "aten.bmm", "aten.addmm"}, f"not only plain matmuls ran: {sorted(operators)}"
    return counter.get_total_flops()


@pytest.mark.parametrize(
    "targets",
    [
        ALL_LINEAR,
        ("q_proj", "v_proj"),  # the classic LoRA: layer 0's attention needs no dK
        ("k_proj",),
        ("o_proj", "down_proj"),  # nothing before layer 0's o_proj needs a gradient
        ("gate_proj",),
    ],
)
def test_step_flops_equal_torch_count(targets):
    batches = [(1, 7), (1, 30), (2, 19)]  # (rows, tokens per row): attention grows with each length squared
    expected = counted_flops(targets, batches)
    lengths = [length for rows, length in batches for _ in range(rows)]
    shape = DecoderShape.from_config(LlamaConfig(**CONFIG))
    assert step_flops(shape, lengths, lora_rank=RANK, lora_targets=targets) == expected


def test_frozen_base_costs_two_thirds_of_full_fine_tuning():
    """Why not 6·N: without LoRA's own terms, attention and layer 0, a step is 4·N per token."""
    shape = DecoderShape.from_config(LlamaConfig(**CONFIG))
    flops = step_flops(shape, [1], lora_rank=0, lora_targets=ALL_LINEAR)
    n_matmul = shape.matmul_parameters()
    first_layer_qkv = sum(
        fan_in * fan_out for name, (fan_in, fan_out) in shape.projections().items() if name[0] in "qkv"
    )
    attention_of_one_token = 12 * shape.num_layers * shape.attention_width
    assert flops == 4 * n_matmul - 2 * first_layer_qkv + attention_of_one_token


def test_the_head_is_counted_only_where_the_loss_needs_logits():
    shape = DecoderShape.from_config(LlamaConfig(**CONFIG))
    every = step_flops(shape, [30, 19], lora_rank=RANK)
    responses = step_flops(shape, [30, 19], lora_rank=RANK, head_positions=20)
    assert every - responses == 4 * shape.hidden_size * shape.vocab_size * (49 - 20)  # forward + input gradient
