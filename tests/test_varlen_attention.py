"""Varlen attention over packed rows (`finetune.training.varlen_attention`): the collator's boundaries, the
exact per-document path on the CPU, the same losses and LoRA gradients as each document forwarded alone, and
transformers' own attention for forwards without boundaries (generation). The CUDA kernel against SDPA is
`tests/test_gpu.py`."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import LIBRARY_ULPS, REORDERED_ULPS, TEST_SHAPE, assert_within_ulps

from finetune.data.collate import collate_batch
from finetune.training.objectives.logprobs import add_targets
from finetune.training.target_loss import target_losses
from finetune.training.varlen_attention import (
    VARLEN_ATTENTION,
    choose_attention,
    unsupported_reason,
    use_varlen_attention,
)


def _model(base_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).train()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    return model


def _documents(rng: random.Random, sizes: list[int]) -> list[dict]:
    documents = []
    for size in sizes:
        ids = [rng.randrange(5, 250) for _ in range(size)]
        documents.append({"input_ids": ids, "labels": [-100] * (size // 3) + ids[size // 3 :]})
    return documents


def _losses_and_grads(model, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    losses = target_losses(model, batch)
    losses.sum().backward()
    return losses.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_boundaries_cover_every_position_with_padding_tails_as_documents():
    documents = _documents(random.Random(0), [7, 5, 3, 2])
    batch = collate_batch(documents, 0, packing=True, row_len=8, document_index=True)
    rows, width = batch["input_ids"].shape
    boundaries = batch["cu_seq_lens"].tolist()
    assert batch["cu_seq_lens"].dtype == torch.int32
    assert boundaries[0] == 0 and boundaries[-1] == rows * width
    segments = [b - a for a, b in zip(boundaries[:-1], boundaries[1:])]
    assert batch["max_length"] == max(segments) == 7
    # every segment is one document or one padding tail, in the order of the flattened rows
    flat = batch["document_index"].flatten().tolist()
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        assert len(set(flat[start:end])) == 1, flat[start:end]
        assert batch["position_ids"].flatten()[start].item() == 0
    documents_of = [flat[start] for start in boundaries[:-1]]
    assert sorted(s for s, d in zip(segments, documents_of) if d >= 0) == [2, 3, 5, 7]
    assert sum(s for s, d in zip(segments, documents_of) if d < 0) == rows * width - 17  # the padding tails

    unpacked = collate_batch(documents, 0, packing=False, document_index=True)
    assert [b - a for a, b in zip(unpacked["cu_seq_lens"][:-1].tolist(), unpacked["cu_seq_lens"][1:].tolist())] == [
        7, 5, 2, 3, 4, 2, 5,
    ]  # fmt: skip


def test_varlen_on_the_cpu_equals_each_document_forwarded_alone(tiny_base_dir):
    rng = random.Random(1)
    documents = _documents(rng, [40, 23, 17, 9, 31])
    model = _model(tiny_base_dir)
    alone = [_losses_and_grads(model, add_targets(collate_batch([d], 0, packing=True, document_index=True)))
             for d in documents]  # fmt: skip
    use_varlen_attention(model)
    packed = add_targets(collate_batch(documents, 0, packing=True, row_len=64, document_index=True))
    assert packed["input_ids"].shape[0] < len(documents)  # several documents share a row
    losses, grads = _losses_and_grads(model, packed)
    expected = torch.cat([part for part, _ in alone])
    assert losses.shape == expected.shape
    assert_within_ulps(losses.sum(), expected.sum(), LIBRARY_ULPS, what="the per-token losses, summed in another order")
    for ours, *theirs in zip(grads, *[g for _, g in alone]):
        total = torch.stack(theirs).sum(0)
        assert_within_ulps(ours, total, REORDERED_ULPS, what="LoRA gradient")  # summed apart


def test_varlen_equals_the_document_mask_path(tiny_base_dir):
    documents = _documents(random.Random(2), [33, 12, 28, 7])
    batch = add_targets(collate_batch(documents, 0, packing=True, row_len=48, document_index=True))
    masked = _model(tiny_base_dir)
    expected, expected_grads = _losses_and_grads(masked, batch)
    varlen = _model(tiny_base_dir)
    use_varlen_attention(varlen)
    losses, grads = _losses_and_grads(varlen, batch)
    assert_within_ulps(losses, expected, REORDERED_ULPS, what="token losses")  # the same sums, in another order
    for ours, theirs in zip(grads, expected_grads):
        assert_within_ulps(ours, theirs, REORDERED_ULPS, what="LoRA gradient")


def test_generation_without_boundaries_uses_transformers_attention(tiny_base_dir):
    """A forward with a padding mask and no boundaries (how the GRPO sampler calls the model) is unchanged."""
    model = _model(tiny_base_dir).eval()
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        use_varlen_attention(model)
        assert model.config._attn_implementation == VARLEN_ATTENTION
        logits = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[0, 2:], expected[0, 2:], rtol=0, atol=0)
    torch.testing.assert_close(logits[1], expected[1], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("setting", "device", "on"), [("auto", "cpu", False), (False, "cpu", False), (True, "cpu", True)]
)
def test_the_setting_and_its_log_line(tiny_base_dir, setting, device, on):
    model = _model(tiny_base_dir).base_model.model
    lines: list[str] = []
    assert choose_attention(setting, model, torch.device(device), lines.append) is on
    assert len(lines) == 1 and lines[0].startswith("attention: ")
    assert (model.config._attn_implementation == VARLEN_ATTENTION) is on


@pytest.mark.gpu
def test_cuda_varlen_kernel_equals_sdpa_per_document_in_bf16():
    """The kernel alone, grouped-query heads included: outputs and input gradients against one SDPA per
    document (the CPU path, run on CUDA), in bf16."""
    from finetune.training.varlen_attention import varlen_attention_forward, varlen_kernel

    assert varlen_kernel() is not None, f"torch {torch.__version__} has no varlen attention"
    documents = _documents(random.Random(3), [90, 41, 64, 17, 120])
    batch = collate_batch(documents, 0, packing=True, row_len=128, document_index=True)
    rows, length = batch["input_ids"].shape
    generator = torch.Generator("cuda").manual_seed(0)
    shapes = {"query": (rows, 8, length, 64), "key": (rows, 2, length, 64), "value": (rows, 2, length, 64)}
    inputs = {name: torch.randn(shape, generator=generator, device="cuda", dtype=torch.bfloat16).requires_grad_()
              for name, shape in shapes.items()}  # fmt: skip
    boundaries = batch["cu_seq_lens"].cuda()
    kwargs = dict(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=batch["max_length"],
                  max_length_k=batch["max_length"])  # fmt: skip
    flash, _ = varlen_attention_forward(torch.nn.Module(), *inputs.values(), None, scaling=0.125, **kwargs)
    flash.float().square().sum().backward()
    flash_grads = [t.grad.clone() for t in inputs.values()]
    for t in inputs.values():
        t.grad = None
    flat = [t.transpose(1, 2).reshape(rows * length, t.shape[1], 64) for t in inputs.values()]
    from finetune.training.varlen_attention import _per_document_sdpa

    expected = _per_document_sdpa(*flat, boundaries, 0.125).reshape(flash.shape)
    expected.float().square().sum().backward()
    torch.testing.assert_close(flash.float(), expected.float(), rtol=0.02, atol=0.02)  # bf16: 8 bits of mantissa
    for ours, theirs in zip(flash_grads, [t.grad for t in inputs.values()]):
        cosine = torch.nn.functional.cosine_similarity(ours.float().flatten(), theirs.float().flatten(), dim=0)
        assert cosine > 0.999, cosine


def test_flash_dtype_is_the_tensors_own_or_autocasts():
    """FlashAttention computes in 16 bits: float32 activations (a 4-bit base's, under bf16 autocast) are cast
    to autocast's dtype as SDPA's autocast rule casts them, and without autocast they get no kernel."""
    from finetune.training.varlen_attention import flash_dtype

    activations = torch.ones(2, 3)
    assert flash_dtype(activations) is None
    assert flash_dtype(activations.bfloat16()) is torch.bfloat16 and flash_dtype(activations.half()) is torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flash_dtype(activations) is torch.bfloat16
        assert flash_dtype(activations.half()) is torch.float16  # already 16-bit: kept


@pytest.mark.gpu
def test_cuda_varlen_takes_float32_activations_under_autocast():
    """A 4-bit base's layers hand attention float32 under bf16 autocast; torch's varlen op refused them
    ("FlashAttention only support fp16 and bf16", found on an H100). Cast as autocast casts SDPA's inputs,
    the result is the bf16 inputs' bit for bit."""
    from finetune.training.varlen_attention import varlen_attention_forward

    documents = _documents(random.Random(5), [70, 33, 25])
    batch = collate_batch(documents, 0, packing=True, row_len=128, document_index=True)
    rows, length = batch["input_ids"].shape
    generator = torch.Generator("cuda").manual_seed(1)
    query, key, value = (torch.randn((rows, heads, length, 64), generator=generator, device="cuda")
                         for heads in (8, 2, 2))  # fmt: skip
    boundaries = batch["cu_seq_lens"].cuda()
    kwargs = dict(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=batch["max_length"],
                  max_length_k=batch["max_length"])  # fmt: skip
    expected, _ = varlen_attention_forward(torch.nn.Module(), query.bfloat16(), key.bfloat16(), value.bfloat16(), None,
                                           scaling=0.125, **kwargs)  # fmt: skip
    with torch.autocast("cuda", dtype=torch.bfloat16):
        actual, _ = varlen_attention_forward(torch.nn.Module(), query, key, value, None, scaling=0.125, **kwargs)
    assert actual.dtype == torch.bfloat16 and torch.equal(actual, expected)


@pytest.mark.gpu
def test_cuda_varlen_training_forward_equals_the_document_mask_in_bf16(tiny_base_dir):
    """A LoRA model's per-token losses and gradients under varlen against the document mask's SDPA."""
    from finetune.device import to_device

    documents = _documents(random.Random(3), [90, 41, 64, 17, 120])
    batch = to_device(add_targets(collate_batch(documents, 0, packing=True, row_len=128, document_index=True)), "cuda")

    def run(varlen: bool):
        model = _model(tiny_base_dir).to("cuda", torch.bfloat16)
        lines: list[str] = []
        assert choose_attention(varlen, model.base_model.model, torch.device("cuda"), lines.append) is varlen, lines
        return _losses_and_grads(model, batch)

    expected, expected_grads = run(False)
    losses, grads = run(True)
    # bf16 activations through two layers: kernels that round differently agree on the sum to about 1%
    assert losses.float().sum().item() == pytest.approx(expected.float().sum().item(), rel=0.01)
    assert (losses.float() - expected.float()).abs().mean().item() < 0.05
    for ours, theirs in zip(grads, expected_grads):
        cosine = torch.nn.functional.cosine_similarity(ours.float().flatten(), theirs.float().flatten(), dim=0)
        assert cosine > 0.98, cosine


def test_bucketed_rows_come_in_few_widths_and_leave_the_losses_unchanged(tiny_base_dir):
    from finetune.data.collate import ROW_BUCKET

    rng = random.Random(4)
    batches = [_documents(rng, [rng.randrange(10, 400) for _ in range(8)]) for _ in range(40)]
    widths = {collate_batch(b, 0, packing=True, document_index=True)["input_ids"].shape[1] for b in batches}
    bucketed = [collate_batch(b, 0, packing=True, layout="bucketed_rows", document_index=True) for b in batches]
    assert {b["input_ids"].shape[1] % ROW_BUCKET for b in bucketed} == {0}
    assert len({b["input_ids"].shape[1] for b in bucketed}) <= 400 // ROW_BUCKET + 1 < len(widths)

    model = _model(tiny_base_dir)
    use_varlen_attention(model)
    documents = batches[0]
    plain, _ = _losses_and_grads(model, add_targets(collate_batch(documents, 0, packing=True, document_index=True)))
    wide = add_targets(collate_batch(documents, 0, packing=True, layout="bucketed_rows", document_index=True))
    losses, _ = _losses_and_grads(model, wide)
    assert_within_ulps(losses, plain, REORDERED_ULPS, what="token losses")  # each document attends alone either way


def test_a_multimodal_models_sliding_window_is_read_from_its_text_config():
    """Gemma 3 4B and up load as `Gemma3ForConditionalGeneration`, whose top config holds no `sliding_window`: varlen
    attention (no window) was taken for it, and its sliding layers trained on whole documents."""
    import transformers

    text = {**TEST_SHAPE, "vocab_size": 64, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)  # fmt: skip
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert getattr(model.config, "sliding_window", None) is None  # the case: only the text config has it
    assert unsupported_reason(model, torch.device("cpu")) == "the model has sliding-window attention"
