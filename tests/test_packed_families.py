"""Packed and padded micro-batches against each document forwarded alone, on the families whose attention is
more than plain causal: sliding-window layers (Mistral, Phi-3: every layer; Gemma 3, gpt-oss: some) with
windows shorter than the documents, attention sinks (gpt-oss), soft-capped logits (Gemma 2). The loss and
every LoRA gradient of the training path (`finetune.training.target_loss`, the mask of
`finetune.training.model_inputs`) must equal those of the model's own forward of each document."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from helpers import with_adapter

from finetune.data.collate import collate_batch
from finetune.training.objectives.logprobs import add_targets
from finetune.training.target_loss import target_losses

SHAPE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, intermediate_size=32)  # fmt: skip
WINDOW = 6
"""Shorter than every document below, so a layer that ignores it attends to more than it should."""
FAMILIES = {
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=WINDOW),
    "phi3": lambda: transformers.Phi3Config(**SHAPE, sliding_window=WINDOW, pad_token_id=0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE,
        head_dim=8,
        sliding_window=WINDOW,
        query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
    # the output logits capped hard enough (0.5) that a loss taken before the cap is visibly off
    "gemma2": lambda: transformers.Gemma2Config(
        **SHAPE,
        head_dim=8,
        sliding_window=WINDOW,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=0.5,
    ),  # fmt: skip
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SHAPE, head_dim=8, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2
    ),
}


def _lora_model(config, attention: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=torch.float32)
    return with_adapter(model).train()


def _documents(sizes: list[int]) -> list[dict]:
    rng = random.Random(3)
    documents = []
    for size in sizes:
        ids = [rng.randrange(3, 120) for _ in range(size)]
        documents.append({"input_ids": ids, "labels": [-100, -100, *ids[2:]]})
    return documents


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def _each_alone(model, documents) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    total = torch.zeros(())
    for document in documents:
        logits = model(input_ids=torch.tensor([document["input_ids"]]), use_cache=False).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(document["labels"][1:]), reduction="sum")
        loss.backward()
        total += loss.detach()
    return total, _grads(model)


def _collated(model, documents, packing: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    batch = add_targets(collate_batch(documents, pad_token_id=0, packing=packing, document_index=True))
    loss = target_losses(model, batch).sum()
    loss.backward()
    return loss.detach(), _grads(model)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sliding_window_layers_keep_their_window_in_a_collated_batch(family, attention, packing):
    if family in ("gpt_oss", "gemma2") and attention == "sdpa":
        pytest.skip("transformers refuses sdpa for gpt-oss (attention sinks) and Gemma 2 (soft-capped scores)")
    model = _lora_model(FAMILIES[family](), attention)
    documents = _documents([17, 11, 9])
    expected_loss, expected_grads = _each_alone(model, documents)
    loss, grads = _collated(model, documents, packing)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    for grad, expected in zip(grads, expected_grads, strict=True):  # float32 sums in another order: 1e-4 of the
        # tensor's largest entry (a dropped window or cap was off by 20% to 160% of it)
        assert (grad - expected).abs().max() <= 1e-4 * expected.abs().max(), (grad - expected).abs().max()
