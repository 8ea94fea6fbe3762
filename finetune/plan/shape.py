"""Count a model's parameters exactly from its config, on the meta device: no weights, no memory.

The model is built with `AutoModelForCausalLM.from_config` under `torch.device("meta")` (tensors with
shapes and no storage) and wrapped with LoRA by the same `finetune.model.wrap_with_lora` that training
uses, so `target_modules` (`all-linear`, lists, regexes), `exclude_modules`, `train_lm_head`,
`train_embed_tokens` and DoRA resolve exactly as in a real run.

Example:
    shape = model_shape(config, recipe.lora)
    shape.lora_params   # 19,660,800 for Llama 3.1 8B, r=8 on q/v/o/gate/up/down
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM

from finetune.adapters.experts import ExpertTensor, expert_tensors, routers, unwrapped
from finetune.errors import ModelError, first_line
from finetune.model import decoder_layers, wrap_with_lora
from finetune.recipe import LoraConfig


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on, counted from one meta-device model."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    quantizable_params: int
    """Weights of the linear layers inside the decoder layers: what bitsandbytes quantizes."""
    other_params: int
    """Everything else (embeddings, an untied output head, norms, biases), counted once when tied."""
    layer_params: int
    """One decoder layer: what FSDP gathers at a time."""
    lora_params: int
    """Trainable LoRA parameters (A, B and DoRA magnitudes) as peft creates them."""
    expert_params: int = 0
    """Mixture of experts: the fused 3D expert tensors (in `other_params`: bitsandbytes quantizes only
    `nn.Linear`, and training keeps them in the model's dtype)."""
    active_params: int = 0
    """Parameters one token computes with: all but the experts it is not routed to (k of E per layer)."""
    router_params: int = 0
    input_embedding_params: int = 0
    """The input embedding: a lookup, which some publishers leave out of active counts (OpenAI's gpt-oss)."""
    expert_lora_params: int = 0
    """The part of `lora_params` on expert tensors (one rank-r pair per expert)."""
    folded_expert_params: int = 0
    """Elements of the targeted expert tensors: peft's `ParamWrapper` folds W + ΔW into a new tensor of that
    size per forward, which the experts' matmuls keep for backward."""
    moe_layers: int = 0
    """Decoder layers whose MLP is a mixture of experts (the others, if any, are dense)."""
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    """One expert's intermediate width (`moe_intermediate_size`, else `intermediate_size`)."""
    shared_intermediate_size: int = 0
    """Width of the dense shared expert every token also goes through (Qwen2-MoE, DeepSeek); 0 without one."""
    own_expert_gate: bool = False
    """The experts gate with their own function (gpt-oss's clamped SwiGLU), which keeps more for backward."""
    model_type: str = ""
    """The config's `model_type` (e.g. llama): which architectures GRPO's lean decode step takes."""
    extra_norm_elements: int = 0
    """Per token, the elements a decoder layer's RMSNorms normalise beyond Llama's two of the hidden width: Gemma 2
    and 3's norms after attention and the MLP, the per-head query and key norms of Qwen 3 and Gemma 3."""
    extra_norm_rows: int = 0
    """Per token, how many rows those norms normalise (each keeps one float32 rsqrt per row)."""
    softcapped_attention: bool = False
    """Attention scores pass through `cap·tanh(s / cap)` (Gemma 2): eager attention keeps one more (heads, T, T)."""
    dora_outputs: int = 0
    """`lora.use_dora`: the output features of a decoder layer's DoRA-wrapped linear layers, summed (averaged over
    the layers): peft's DoRA keeps two tensors of that width per token for backward."""
    dora_linears: tuple[tuple[int, int], ...] = ()
    """`lora.use_dora`: the distinct (in, out) features of the decoder layers' DoRA-wrapped linear layers, whose
    forward builds an in x in identity and an (in, out) LoRA product each time (a transient, not kept)."""

    @property
    def base_params(self) -> int:
        return self.quantizable_params + self.other_params


def _unique_numel(parameters: Any) -> int:
    """Parameter count with tied tensors counted once."""
    return sum(p.numel() for p in {id(p): p for p in parameters}.values())


def model_shape(config: Any, lora: LoraConfig) -> ModelShape:
    """Build `config`'s model on the meta device, wrap it as training would, and count."""
    try:  # numbers no model can have (0 heads, a negative width, a pad id past the vocabulary) fail inside the
        # model's constructor; torch's Embedding checks its padding_idx with `assert`
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, ZeroDivisionError, RuntimeError, AssertionError) as exc:
        raise ModelError(
            f"cannot build a {getattr(config, 'model_type', '?')} model from its config.json: {first_line(exc)}; "
            "fix the config (or give --config another one)"
        ) from None
    layers = decoder_layers(model)
    if not layers:
        raise ModelError(f"{type(model).__name__} has no decoder layers (num_hidden_layers 0, or no layer class "
                         "named by _no_split_modules); cannot plan it")  # fmt: skip
    quantizable = sum(
        module.weight.numel() for layer in layers for module in layer.modules() if isinstance(module, torch.nn.Linear)
    )
    total = _unique_numel(model.parameters())
    layer_params = max(_unique_numel(layer.parameters()) for layer in layers)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = expert_tensors(model)
    _check_sizes(text, experts)
    expert_params = sum(math.prod(e.shape) for e in experts)
    routed = _experts_per_token(text) / experts[0].num_experts if experts else 1.0
    router_params = sum(p.numel() for name in routers(model, experts) for p in model.get_submodule(name).parameters())
    with torch.device("meta"):  # LoRA weights with shapes only: initialising 0.6B of them for real takes a minute
        peft_model = wrap_with_lora(model, lora)
    lora_params = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    expert_lora, folded = _expert_lora(peft_model)
    dora = _dora_linears(peft_model)
    return ModelShape(
        **_moe_widths(text, model, experts),
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
        num_layers=len(layers),
        num_heads=text.num_attention_heads,
        vocab_size=text.vocab_size,
        quantizable_params=quantizable,
        other_params=total - quantizable,
        layer_params=layer_params,
        lora_params=lora_params,
        expert_params=expert_params,
        active_params=total - round(expert_params * (1 - routed)),
        router_params=router_params,
        input_embedding_params=model.get_input_embeddings().weight.numel(),
        model_type=getattr(text, "model_type", ""),
        **_extra_norms(layers[0], text),
        softcapped_attention=bool(getattr(text, "attn_logit_softcapping", None)),
        expert_lora_params=expert_lora,
        folded_expert_params=folded,
        dora_outputs=sum(out for _, out in dora) // len(layers),
        dora_linears=tuple(sorted(set(dora))),
    )


def _dora_linears(peft_model: torch.nn.Module) -> list[tuple[int, int]]:
    """(in, out) features of every DoRA-wrapped linear layer inside the decoder layers (one entry per layer)."""
    found = []
    for layer in decoder_layers(peft_model):
        for module in layer.modules():
            base = getattr(module, "base_layer", None)
            if getattr(module, "lora_magnitude_vector", None) and isinstance(base, torch.nn.Linear):
                found.append((base.in_features, base.out_features))
    return found


def _moe_widths(text: Any, model: torch.nn.Module, experts: list[ExpertTensor]) -> dict[str, Any]:
    """The sizes a mixture of experts' activations depend on (see `plan.memory.expert_activation_bytes_per_token`)."""
    if not experts:
        return {}
    owners = sorted({e.owner for e in experts})
    expert_width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared = getattr(text, "shared_expert_intermediate_size", None) or 0
    shared = shared or (getattr(text, "n_shared_experts", None) or 0) * expert_width
    # transformers gives every experts class a gate: its own (`_apply_gate` in the class) or the default SwiGLU
    gate = getattr(type(unwrapped(model.get_submodule(owners[0]))), "_apply_gate", None)
    return dict(
        moe_layers=len(owners),
        num_experts=experts[0].num_experts,
        experts_per_token=_experts_per_token(text),
        expert_intermediate_size=expert_width,
        shared_intermediate_size=shared,
        own_expert_gate=gate is not None and gate.__name__ != "_default_apply_gate",
    )


def _extra_norms(layer: torch.nn.Module, text: Any) -> dict[str, Any]:
    """`extra_norm_elements` and `extra_norm_rows` of one decoder layer: a `q_norm` or `k_norm` as wide as a head
    normalises every query or key head of a token, any other norm its own width once."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    heads_of = {"q_norm": heads, "k_norm": getattr(text, "num_key_value_heads", None) or heads}
    elements = rows = 0
    for name, module in layer.named_modules():
        weight = getattr(module, "weight", None)
        if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        width = weight.shape[0]
        count = heads_of.get(name.rsplit(".", 1)[-1], 1) if width == head_dim else 1
        elements, rows = elements + count * width, rows + count
    return dict(extra_norm_elements=max(0, elements - 2 * text.hidden_size), extra_norm_rows=max(0, rows - 2))


def _check_sizes(text: Any, experts: list[ExpertTensor]) -> None:
    """Refuse sizes a model builds with on the meta device but cannot run with, which the plan would divide by
    (a vocabulary of 0 tokens) or turn into nonsense (more experts routed per token than there are: more active
    parameters than parameters; `torch.topk` fails on the first forward), or key/value heads that do not divide
    the attention heads (the attention's first forward fails)."""
    fix = "fix the config (or give --config another one)"
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ModelError(f"config.json vocab_size {vocab!r}: a model needs at least one token; {fix}")
    if experts and _experts_per_token(text) > experts[0].num_experts:
        raise ModelError(f"config.json routes {_experts_per_token(text)} experts per token but has only "
                         f"{experts[0].num_experts}; {fix}")  # fmt: skip
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        raise ModelError(f"config.json has {heads} attention heads in {kv_heads} key/value groups, which do not "
                         f"divide them (grouped-query attention repeats each key/value head alike); {fix}")  # fmt: skip


def _experts_per_token(text: Any) -> int:
    """k of top-k routing, whatever the family calls it."""
    for key in ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelError(f"{type(text).__name__} has experts but names no number of experts per token; cannot plan it")


def _expert_lora(peft_model: torch.nn.Module) -> tuple[int, int]:
    """(LoRA parameters on expert tensors, elements of the expert tensors they target)."""
    lora = folded = 0
    for module in peft_model.modules():
        if type(module).__name__ == "ParamWrapper" and getattr(module, "num_experts", 1) > 1:
            lora += sum(
                p.numel() for name, p in module.named_parameters() if "lora_" in name and "base_layer" not in name
            )
            wrapped = cast(Callable[[], torch.Tensor], module.get_param)  # ParamWrapper: the tensor it wraps
            folded += wrapped().numel()
    return lora, folded
