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


def test_gemmas_norm_takes_its_own_lean_forward_and_another_norm_keeps_its_own():
    """Gemma's norm multiplies by `1 + weight` in float32 before rounding (its weight starts at 0, where Llama's lean
    norm would give 0); a `*RMSNorm` of neither form keeps transformers' forward."""
    gemma = GemmaRMSNorm(64)
    assert use_lean_activations(gemma) == 1 and "forward" in gemma.__dict__

    class ScaledRMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = torch.nn.Parameter(torch.ones(64)), 1e-6

        def forward(self, x):
            return 2 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    other = ScaledRMSNorm()
    assert use_lean_activations(other) == 0 and "forward" not in other.__dict__


def test_an_mlp_with_a_dropout_of_its_own_keeps_its_own_forward():
    """A dropout inside the MLP acts in training mode only, where the eval-mode probe cannot see it."""
    layer, _ = _layer(128, 256, torch.float32)
    layer.mlp.dropout = torch.nn.Dropout(0.1)
    assert use_lean_activations(layer.mlp) == 0 and "forward" not in layer.mlp.__dict__


def _family_layer(config_name: str, dtype: torch.dtype):
    """Decoder layer 0 of a shipped catalog config shrunk to d 256, i 512, its linear layers passing gradients on."""
    from transformers import AutoModelForCausalLM

    from finetune.plan.model_config import SHIPPED_CONFIGS, config_from_json

    config = config_from_json(SHIPPED_CONFIGS / config_name)
    for key, value in dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, vocab_size=64).items():  # fmt: skip
        setattr(config, key, value)
    config.layer_types = (getattr(config, "layer_types", None) or ["full_attention"])[:1]
    config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
    config._attn_implementation = "eager" if "gemma-2" in config_name else "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.endswith("proj.weight"))  # as LoRA's base layers: gradients pass through them
        if "norm" in name:
            parameter.data.normal_(0, 0.5)  # trained-looking norm weights (Gemma's start at 0)
    return model


@pytest.mark.parametrize(
    ("config_name", "lean_modules"),
    [("google/gemma-3-1b-it.json", 7), ("google/gemma-2-2b-it.json", 5), ("microsoft/Phi-4-mini-instruct.json", 3),
     ("Qwen/Qwen3-0.6B.json", 5)],
    ids=["gemma3-4-norms-qk-norms-gelu", "gemma2-4-norms-gelu", "phi-fused-gate-up", "qwen3-qk-norms"],
)  # fmt: skip
def test_other_families_norms_and_mlps_give_the_same_outputs_and_gradients(config_name, lean_modules):
    """Gemma's `(1 + w)` norm and tanh-GeLU MLP, Phi-3's fused gate/up MLP, Qwen 3's per-head norms: outputs bit for
    bit, input gradients to float32 rounding, in bf16 under autocast; and they keep less for backward."""
    plain = _family_layer(config_name, torch.bfloat16)
    lean = copy.deepcopy(plain)
    assert use_lean_activations(lean.model.layers[0]) == lean_modules
    results, kept = [], []
    for model in (plain, lean):
        embeds = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        embeds.requires_grad_(True)
        saved: dict = {}
        skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {embeds.untyped_storage().data_ptr()}

        def pack(tensor, saved=saved, skip=skip):
            if tensor.untyped_storage().data_ptr() not in skip:
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model.model(inputs_embeds=embeds).last_hidden_state
        out.float().pow(2).sum().backward()
        results.append((out, embeds.grad))
        kept.append(sum(saved.values()))
    (out, grad), (lean_out, lean_grad) = results
    assert torch.equal(lean_out, out)
    scale = grad.abs().max().item()
    torch.testing.assert_close(lean_grad, grad, rtol=0, atol=8 * torch.finfo(torch.bfloat16).eps * scale)
    assert kept[1] < kept[0], kept
