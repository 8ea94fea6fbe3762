"""A decode step of a Llama-family model as a handful of tensor ops, with the LoRA update merged in.

A decode step feeds one token per row. On a small model, or any model on a GPU at small batch, its time is
the host's: transformers' decoder layers call a module per norm, projection and activation, and peft's LoRA
layers three matrix products and their bookkeeping per projection. On the embedded base (4 layers) that was
85 matrix products and about 6.5 ms per step on 2 CPU cores, against 17 products here.

`LeanDecoder.of(model)` reads the model's weights once per sampling call and merges each LoRA update into a
copy of its projection (W + s·B·A, computed in float32), with q, k and v stacked into one matrix and the
MLP's gate and up into another (`Merged`); `step` then runs the same arithmetic as transformers' forward
(RMSNorm, rotary embeddings from the model's own rotary module, grouped-query attention over the cache,
SwiGLU) on those. Its logits equal the model's within float rounding, not bit for bit: the samples come from
the policy the loss scores, as with any inference engine (vLLM merges too). The prefill stays the model's
own forward, since it needs the causal and padding masks.

The copies live only while sampling, but a large base on a small card has no room for a second set of its
weights: where they would take more than `MEMORY_SHARE` of the device's memory, the step runs over the
model's own weights instead, each projection as peft computes it (`InPlace`: more products, no copy).

It declines (returns None; the caller keeps the model's forward) for anything it does not reproduce:
other architectures (only transformers' own llama, mistral, qwen2 and qwen3 classes), sliding-window
attention, an activation other than SiLU, a quantized or sharded base (FSDP2 and ZeRO-3 gather weights
only inside the forward), modules with hooks or a forward replaced by another library (accelerate's
offloading, a patching library's kernels), LoRA variants (DoRA) or several active adapters, and adapters
on the embeddings.

Example:
    decoder = LeanDecoder.of(model)          # model in eval mode; the prefill is the model's own forward
    logits = decoder.step(token_ids, batch)  # (B,) ids, a KVBatch -> (B, V)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from finetune.generation.lean_lora import lean_forward, plain_lora_parts

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
MEMORY_SHARE = 1 / 8  # the most of the device's memory the merged copies may take


@dataclass(frozen=True)
class Norm:
    """An RMSNorm's weight and epsilon."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """As transformers' Llama RMSNorm: normalised in float32, cast back, then scaled by the weight."""
        if x.dtype == torch.float32:  # the casts would be two more ops that do nothing
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


Projection = Callable[[torch.Tensor], torch.Tensor]
"""(B, in) -> (B, out): one or more of a layer's linear projections of the same input, side by side."""


@dataclass(frozen=True)
class Layer:
    """One decoder layer's parts: q/k/v as one projection, gate/up as another."""

    input_norm: Norm
    qkv: Projection
    q_norm: Norm | None  # Qwen3 normalises each head's queries and keys
    k_norm: Norm | None
    out: Projection
    post_norm: Norm
    gate_up: Projection
    down: Projection
    scaling: float


class Merged:
    """Projections of the same input with their LoRA updates merged (W + s·B·A, in float32 as peft merges on
    the CPU, then cast to the base's dtype), stacked and stored transposed (in, out): one product, a copy."""

    def __init__(self, modules: list[Any]):
        parts = [_merged(module) for module in modules]
        self.weight_t = torch.cat([weight for weight, _ in parts]).t().contiguous()
        self.bias = None
        if any(bias is not None for _, bias in parts):  # zeros where one has none
            self.bias = torch.cat([w.new_zeros(len(w)) if b is None else b for w, b in parts]).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x @ Wᵀ (+ b) with Wᵀ stored (in, out): on a CPU, `F.linear`'s (out, in) weight took up to 4x longer
        for a decode step's few rows (8 x 128 against 384 x 128: 60 µs against 15 µs, 2 threads)."""
        return x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)


class InPlace:
    """Projections of the same input over the model's own weights, no copy: each one's base product plus its
    LoRA's two (peft's arithmetic bit for bit, as `lean_lora`), concatenated. For a base whose merged copy
    would not fit."""

    def __init__(self, modules: list[Any]):
        self.forwards = [lean_forward(module) or _plain_forward(module) for module in modules]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [forward(x) for forward in self.forwards]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


class LeanDecoder:
    """A Llama-family model's decode step over merged weights (see the module docstring)."""

    def __init__(self, model: Any, layers: list[Layer], embed: torch.Tensor, final_norm: Norm, head: Projection):
        config = model.config
        self.rotary = model.model.rotary_emb
        self.layers = layers
        self.embed = embed
        self.final_norm = final_norm
        self.head = head
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads

    @classmethod
    def of(cls, model: Any) -> LeanDecoder | None:
        """The decoder for `model` (a transformers causal LM or a peft model of one, in eval mode), or None if it
        declines (`declined_because` says why). Over merged copies where they fit (`fits_merged`), else over
        the model's own weights."""
        inner = _inner(model)
        if inner.training or declined_because(model) is not None:
            return None
        kind = Merged if fits_merged(inner) else InPlace
        with torch.no_grad():
            layers = [_layer(layer, kind) for layer in inner.model.layers]
            norm = inner.model.norm
            final_norm = Norm(norm.weight, norm.variance_epsilon)
            return cls(inner, layers, inner.model.embed_tokens.weight, final_norm, kind([inner.lm_head]))

    @property
    def merged(self) -> bool:
        """Whether the step runs over merged copies (else over the model's own weights)."""
        return isinstance(self.head, Merged)

    def step(self, token_ids: torch.Tensor, batch: Any) -> torch.Tensor:
        """Feed one token per row of `batch` (a KVBatch after `advance`): the next-token logits (B, V)."""
        rows, heads, kv_heads, dim = len(token_ids), self.heads, self.kv_heads, self.head_dim
        hidden = F.embedding(token_ids, self.embed)  # (B, H): one position per row throughout
        cos, sin = self.rotary(hidden[:, None], batch.positions)  # (B, 1, d)
        rotation = _Rotation(cos[:, None], sin[:, None])  # (B, 1, 1, d) against (B, heads, 1, d)
        mask = batch.mask[:, None, None, :].bool()  # (B, 1, 1, T): padded slots masked out
        q_size, kv_size = heads * dim, kv_heads * dim
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(layer.input_norm(hidden))
            v = qkv[:, q_size + kv_size :].view(rows, kv_heads, 1, dim)
            if layer.q_norm is not None and layer.k_norm is not None:  # each head normalised, then rotated
                q = rotation(layer.q_norm(qkv[:, :q_size].view(rows, heads, 1, dim)))
                k = rotation(layer.k_norm(qkv[:, q_size : q_size + kv_size].view(rows, kv_heads, 1, dim)))
            else:  # queries and keys rotated together
                qk = rotation(qkv[:, : q_size + kv_size].view(rows, heads + kv_heads, 1, dim))
                q, k = qk[:, :heads], qk[:, heads:]
            keys, values = batch.cache.layers[index].update(k, v)
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling,
                                                      enable_gqa=heads != kv_heads)  # fmt: skip
            hidden = hidden + layer.out(attended.reshape(rows, q_size))
            gate, up = layer.gate_up(layer.post_norm(hidden)).chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up)
        return self.head(self.final_norm(hidden))


class _Rotation:
    """Rotary position embedding as transformers' Llama applies it, x·cos + rotate_half(x)·sin, in 4 ops:
    rotate_half(x)·sin = (−x₂·sin₁, x₁·sin₂) = roll(x, d/2)·(−sin₁, sin₂), the same products bit for bit."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        half = sin.shape[-1] // 2
        self.cos, self.half = cos, half
        self.signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos + x.roll(self.half, dims=-1) * self.signed_sin


def declined_because(model: Any) -> str | None:
    """Why the lean step would not decode `model` in eval mode (None: it would), in a few words for the log.
    The weights first: FSDP2 also swaps the model's class for a subclass of its own."""
    inner = _inner(model)
    for parameter in inner.parameters():
        if not parameter.is_floating_point():
            return "the base is quantized"  # bitsandbytes' packed 4-bit or int8 weights
        if type(parameter.data) is not torch.Tensor or hasattr(parameter, "ds_numel") or parameter.is_meta:
            return "the weights are sharded or offloaded"  # a DTensor (FSDP2), a ZeRO-3 shard, not loaded
    config = getattr(inner, "config", None)
    if not type(inner).__module__.startswith("transformers.models."):
        return f"{type(inner).__name__} is not one of transformers' own classes"
    reason = config_declined_because(config)
    if reason is not None:
        return reason
    if not all(_computes_its_class(module) for module in inner.modules()):
        return "a module has hooks or a forward another library replaced"
    return _parts_declined(inner)


def config_declined_because(config: Any) -> str | None:
    """Why a model of this config (transformers' or config.json's fields as attributes) is not one the lean
    arithmetic reproduces (None: it is): the family, sliding windows, the activation, a partial rotary."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"{family} models are not among transformers' own {', '.join(sorted(FAMILIES))} classes"
    if getattr(config, "sliding_window", None) is not None or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or []
    ):
        return "sliding-window attention"
    if getattr(config, "hidden_act", None) != "silu" or (getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "an activation other than SiLU or a partial rotary embedding"
    return None


def _parts_declined(inner: Any) -> str | None:
    """Why the model's parts are not ones the step computes: embeddings, norms, projections."""
    if type(inner.model.embed_tokens) is not torch.nn.Embedding:
        return "the embeddings have an adapter"
    for layer in inner.model.layers:
        norms = [layer.input_layernorm, layer.post_attention_layernorm, inner.model.norm]
        norms += [norm for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None))
                  if norm is not None]  # fmt: skip
        if not all(type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon") for norm in norms):
            return "a norm other than RMSNorm"
        for module in (*_attention_projections(layer), *_mlp_projections(layer), inner.lm_head):
            if type(module) is not torch.nn.Linear and plain_lora_parts(module, eval_only=False) is None:
                return f"a {type(module).__name__} layer that is not a plain LoRA (a variant such as DoRA, or several)"
    return None


def fits_merged(model: Any) -> bool:
    """Would the merged copies of `model`'s projections take at most `MEMORY_SHARE` of its device's memory?"""
    return _copies_fit(_inner(model))[1]


def _copies_fit(inner: Any) -> tuple[int, bool]:
    """The merged copies' bytes, and whether they are within `MEMORY_SHARE` of the device's memory."""
    copies = _copies_bytes(inner)
    return copies, copies <= MEMORY_SHARE * _device_memory(inner.lm_head.weight)


def describe_generation(model: Any) -> str:
    """The log line saying how sampling will decode `model` (a run's first lines say which speed-ups are on)."""
    reason = declined_because(model)
    if reason is not None:
        return f"generation: the model's own forward per token (no lean decode step: {reason})"
    copies, fits = _copies_fit(_inner(model))
    if fits:
        return f"generation: lean decode steps, the LoRA merged into a copy of the weights while sampling ({copies / 2**20:,.1f} MiB)"
    return (f"generation: lean decode steps over the model's own weights, the LoRA unmerged (a merged copy would "
            f"take {copies / 2**30:.2f} GiB, over 1/{round(1 / MEMORY_SHARE)} of the device's memory)")  # fmt: skip


def _inner(model: Any) -> Any:
    """The transformers model inside a peft model (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _computes_its_class(module: torch.nn.Module) -> bool:
    """No hooks, and a forward that is the class's or one of finetune's own equal ones (training's lean
    activations, checked bit for bit against the class's when they are set)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    forward = module.__dict__.get("forward")
    return forward is None or getattr(forward, "__module__", "").startswith("finetune.")


def _device_memory(weight: torch.Tensor) -> float:
    """The memory of the device `weight` is on, in bytes (the machine's RAM for the CPU)."""
    if weight.device.type == "cuda":
        return float(torch.cuda.get_device_properties(weight.device).total_memory)
    if weight.device.type == "cpu" and hasattr(os, "sysconf"):
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return 0.0  # unknown device: decline


def _copies_bytes(model: Any) -> int:
    """Bytes of the merged copies: every decoder layer's projections and the head."""
    head = _base(model.lm_head).weight
    total = head.numel() * head.element_size()
    for layer in model.model.layers:
        for module in (*_attention_projections(layer), *_mlp_projections(layer)):
            weight = _base(module).weight
            total += weight.numel() * weight.element_size()
    return total


def _attention_projections(layer: Any) -> tuple[Any, Any, Any, Any]:
    attention = layer.self_attn
    return attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj


def _mlp_projections(layer: Any) -> tuple[Any, Any, Any]:
    return layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj


def _base(module: Any) -> Any:
    return getattr(module, "base_layer", module)


def _layer(layer: Any, kind: type[Merged] | type[InPlace]) -> Layer:
    attention = layer.self_attn
    q, k, v, out = _attention_projections(layer)
    gate, up, down = _mlp_projections(layer)
    q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
    return Layer(
        input_norm=_norm(layer.input_layernorm), qkv=kind([q, k, v]),
        q_norm=None if q_norm is None else _norm(q_norm), k_norm=None if k_norm is None else _norm(k_norm),
        out=kind([out]), post_norm=_norm(layer.post_attention_layernorm), gate_up=kind([gate, up]),
        down=kind([down]), scaling=float(attention.scaling),
    )  # fmt: skip


def _norm(module: Any) -> Norm:
    return Norm(module.weight, float(module.variance_epsilon))


def _merged(module: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a projection: a plain `nn.Linear`'s own, or a plain LoRA layer's base weight with
    s·B·A added (in float32, as peft merges on the CPU, then cast to the base's dtype)."""
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    parts = plain_lora_parts(module)
    assert parts is not None, "declined_because checked every projection"
    base, lora_a, lora_b, scaling = parts
    delta = (lora_b.weight.float() @ lora_a.weight.float()) * scaling
    return (base.weight.float() + delta).to(base.weight.dtype), base.bias


def _plain_forward(module: torch.nn.Linear) -> Projection:
    """A plain `nn.Linear`'s product (the projections without an adapter)."""
    weight, bias = module.weight, module.bias
    return lambda x: F.linear(x, weight, bias)
