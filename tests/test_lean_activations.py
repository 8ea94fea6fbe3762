"""Training's lean RMSNorm and gated MLP: the same outputs bit for bit, the same gradients (bit for bit in float32,
the 16-bit norms' to float32 rounding), and 6·d + 2·i fewer bytes saved per token and layer in bf16, as `finetune
plan` counts; a norm that computes something else (Gemma's `1 + weight`) keeps its own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from finetune.training.lean_activations import use_lean_activations


def _layer(d: int, i: int, dtype: torch.dtype) -> tuple[LlamaDecoderLayer, LlamaRotaryEmbedding]:
    config = LlamaConfig(hidden_size=d, intermediate_size=i, num_attention_heads=d // 64, num_key_value_heads=2,
                         head_dim=64, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(dtype)
    for parameter in layer.parameters():  # a frozen base whose linear layers (as under LoRA) pass gradients on
        parameter.requires_grad_(False)
    layer.mlp.gate_proj.weight.requires_grad_(True)
    layer.mlp.down_proj.weight.requires_grad_(True)
    return layer, LlamaRotaryEmbedding(config)


def _forward(layer, rope, x, autocast: bool, saved: dict | None = None) -> torch.Tensor:
    """The layer's output; `saved`: storage -> bytes of every tensor kept for backward, but x and parameters."""
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}

    def pack(tensor):
        if saved is not None and tensor.untyped_storage().data_ptr() not in skip:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    positions = torch.arange(x.shape[1])[None]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(x, position_embeddings=rope(x, positions), position_ids=positions)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, False), (torch.bfloat16, True)])
def test_the_same_outputs_and_gradients(dtype, autocast):
    plain, rope = _layer(256, 512, dtype)
    lean = copy.deepcopy(plain)
    assert use_lean_activations(lean) == 3  # two norms and the MLP
    results = []
    for layer in (plain, lean):
        x = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
        out = _forward(layer, rope, x, autocast)
        out.float().pow(2).sum().backward()
        results.append((out, x.grad, layer.mlp.gate_proj.weight.grad, layer.mlp.down_proj.weight.grad))
    (out, x_grad, *weights), (lean_out, lean_x_grad, *lean_weights) = results
    assert torch.equal(lean_out, out)
    assert all(torch.equal(a, b) for a, b in zip(lean_weights, weights))  # the MLP's gradients: the same kernels
    if dtype == torch.float32:  # the norms keep their own forward on float32 inputs: a float32 run is unchanged
        assert torch.equal(lean_x_grad, x_grad)
    scale = x_grad.abs().max().item()  # the 16-bit norms' backward sums in another order: float32 rounding apart
    torch.testing.assert_close(lean_x_grad, x_grad, rtol=0, atol=4 * torch.finfo(torch.float32).eps * scale)


def test_a_bf16_layer_saves_six_d_plus_two_i_bytes_per_token_less():
    d, i, tokens = 256, 1024, 64
    plain, rope = _layer(d, i, torch.bfloat16)
    lean = copy.deepcopy(plain)
    use_lean_activations(lean)
    kept = []
    for layer in (plain, lean):
        saved: dict = {}
        x = torch.randn(1, tokens, d, dtype=torch.bfloat16, requires_grad=True)
        _forward(layer, rope, x, autocast=True, saved=saved)
        kept.append(sum(saved.values()))
    assert kept[0] - kept[1] == (6 * d + 2 * i) * tokens, kept


def test_a_norm_that_computes_otherwise_keeps_its_own_forward():
    norm = GemmaRMSNorm(64)  # weight starts at 0: x·rsqrt(...)·(1 + 0), where the lean norm would give 0
    assert use_lean_activations(norm) == 0 and "forward" not in norm.__dict__


def test_an_mlp_with_a_dropout_of_its_own_keeps_its_own_forward():
    """A dropout inside the MLP acts in training mode only, where the eval-mode probe cannot see it."""
    layer, _ = _layer(128, 256, torch.float32)
    layer.mlp.dropout = torch.nn.Dropout(0.1)
    assert use_lean_activations(layer.mlp) == 0 and "forward" not in layer.mlp.__dict__
