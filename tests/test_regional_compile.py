"""`train.compile` compiles each decoder layer with fullgraph=True: no graph break, no recompilation once the
shapes are warm, and the same losses and gradients as eager.

Slow (compiling takes minutes on a loaded 2-core CPU): run with `-m slow`.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import LIBRARY_ULPS, assert_within_ulps

from finetune.data.collate import collate_batch
from finetune.training.objectives.logprobs import add_targets
from finetune.training.regional_compile import compile_layers
from finetune.training.target_loss import target_losses
from finetune.training.varlen_attention import use_varlen_attention

pytestmark = pytest.mark.slow


def _model(base_dir, dropout: float, nf4: bool = False):
    """The tiny base with LoRA on every linear layer, B drawn as if trained; `nf4`: the base quantized to 4 bits
    by bitsandbytes, float32 compute, its float kernels kept (as finetune loads it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.adapters.quantized import keep_float_kernels

    quantized = {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        ),
        "device_map": {"": "cpu"},
    }
    model = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="sdpa", **(quantized if nf4 else {})
    )
    keep_float_kernels(model)
    model.config.use_cache = False
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
    model = get_peft_model(model, lora).train()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)
    return model


def _batch(rng: random.Random, length: int, sizes=None, layout="rows") -> dict[str, torch.Tensor]:
    documents = []
    for size in sizes or (length, length // 2, length // 3):
        ids = [rng.randrange(5, 250) for _ in range(size)]
        documents.append({"input_ids": ids, "labels": [-100] * (size // 3) + ids[size // 3 :]})
    return add_targets(collate_batch(documents, 0, packing=True, layout=layout, document_index=True))


def _step(model, batch) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    loss = target_losses(model, batch).sum()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_compiled_layers_equal_eager_without_graph_breaks_or_recompiles(tiny_base_dir):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rng = random.Random(0)
    lengths = [64, 96, 128]
    batches = [_batch(rng, n) for n in lengths]
    eager, compiled = _model(tiny_base_dir, 0.0), _model(tiny_base_dir, 0.0)
    assert compile_layers(compiled, quantized=False, say=lambda line: None) == 2
    for batch in batches:  # warm-up: each shape once (the second one makes the graphs dynamic)
        _step(compiled, batch)
    warm = dict(counters["stats"])
    _assert_warm_and_equal_to_eager(eager, compiled, batches, warm)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Forwards that record no gradients (evaluation, reference log-probabilities, sampling) run the eager layers:
    # new shapes and another grad mode compile nothing (on an H100 they hit torch's recompile limit), same logits
    for width in (17, 33, 1):
        ids = torch.randint(5, 250, (2, width))
        with torch.no_grad():
            expected = eager(input_ids=ids).logits
            assert torch.equal(compiled(input_ids=ids).logits, expected)
        with torch.inference_mode():
            assert torch.equal(compiled(input_ids=ids).logits, expected)
    assert dict(counters["stats"]) == warm, "compiled a forward that records no gradients"

    # LoRA dropout and varlen attention (its compiled CPU path) inside the graph, over an epoch of bucketed rows:
    # still one graph per layer, and nothing compiles again once each width was seen twice
    dropout = _model(tiny_base_dir, 0.05)
    use_varlen_attention(dropout)
    compile_layers(dropout, quantized=False, say=lambda line: None)
    epoch = [_batch(rng, 0, [rng.randrange(8, 250) for _ in range(rng.randrange(2, 7))], "bucketed_rows")
             for _ in range(12)]  # fmt: skip
    widths = {batch["input_ids"].shape for batch in epoch}
    assert len(widths) > 2
    for batch in epoch[:6]:
        _step(dropout, batch)
    warm = dict(counters["stats"])
    for batch in epoch[6:]:
        _step(dropout, batch)
    assert dict(counters["stats"]) == warm, f"recompiled within an epoch of {len(widths)} shapes"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_on_a_4_bit_base_the_layers_compile_around_the_quantized_matmuls_and_equal_eager(tiny_base_dir):
    """`train.compile: true` on a bitsandbytes base: bitsandbytes 0.50 registers its 4-bit ops with torch, so
    dynamo traces each layer whole, the quantized matmuls included (no graph break, although `compile_layers`
    allows them there), computes what eager computes, and compiles nothing again once the shapes are warm."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rng = random.Random(1)
    batches = [_batch(rng, n) for n in (64, 96, 128)]
    eager, compiled = _model(tiny_base_dir, 0.0, nf4=True), _model(tiny_base_dir, 0.0, nf4=True)
    assert compile_layers(compiled, quantized=True, say=lambda line: None) == 2
    for batch in batches:
        _step(compiled, batch)
    assert not counters["graph_break"], dict(counters["graph_break"])
    _assert_warm_and_equal_to_eager(eager, compiled, batches, dict(counters["stats"]))


def _assert_warm_and_equal_to_eager(eager, compiled, batches, warm: dict) -> None:
    """The shapes of `batches` again: nothing new compiles (`warm`: dynamo's counters after the warm-up), and the
    compiled layers' losses and LoRA gradients are eager's."""
    from torch._dynamo.utils import counters

    for batch in batches:
        expected_loss, expected_grads = _step(eager, batch)
        loss, grads = _step(compiled, batch)
        # inductor's generated kernels fuse and order the sums their own way: another library's op order
        assert_within_ulps(loss, expected_loss, LIBRARY_ULPS, what="loss")
        for ours, theirs in zip(grads, expected_grads):
            assert_within_ulps(ours, theirs, LIBRARY_ULPS, what="LoRA gradient")
    assert dict(counters["stats"]) == warm, "recompiled after warm-up"
