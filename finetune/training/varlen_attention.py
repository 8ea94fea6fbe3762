"""`train.varlen_attention`: attention over packed rows from the documents' boundaries, with no mask at all.

A packed micro-batch holds several documents per row. The mask path (`finetune.training.document_mask`)
builds an (R, 1, T, T) mask, and a masked `scaled_dot_product_attention` cannot use the flash kernel: it
computes and reads every pair of the row. torch's own FlashAttention for variable lengths
(`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10, CUDA) takes the rows flattened to (R·T, heads,
dim) and the cumulative document boundaries `cu_seq_lens` (int32, documents + 1), and computes each
document's causal attention alone. The collator computes the boundaries and the longest document on the host
(`finetune.data.collate`), so nothing here asks the device anything. A row's padding tail is a document
of its own, so every position belongs to one.

The function is registered with transformers' attention interface under `VARLEN_ATTENTION`, and the model's
forward takes the boundaries as keyword arguments under transformers' own names (`cu_seq_lens_q`,
`max_length_q`, ...), which every decoder layer hands to its attention. A training forward passes a
placeholder 4D `attention_mask` that transformers returns as given (it builds no mask and does not look for
packed documents in `position_ids`, which waits on the device). A forward without boundaries (generation
inside a GRPO step) gets transformers' own SDPA mask and attention, so the model generates as before.

Where the CUDA kernel is missing (the CPU, torch < 2.10) the same boundaries run an exact path: one causal
SDPA per document, or inside `torch.compile` the document mask built from them on the device. `train.varlen_attention: auto` turns varlen on where it is fast (CUDA with the kernel, a
16-bit base) and keeps the mask path on the CPU; `true` asks for it anywhere (the CPU tests use it), `false`
keeps the mask.

Example:
    use_varlen_attention(peft_model)                  # once, after loading
    outputs = model(**model_inputs(model, batch))     # `finetune.training.model_inputs` passes the boundaries
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from finetune.scoring import transformers_model
from finetune.training.document_mask import document_mask

VARLEN_ATTENTION = "finetune_varlen"
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


_kernel: Callable[..., Any] | None = None
_kernel_parameters: frozenset[str] = frozenset()


def varlen_kernel() -> Callable[..., Any] | None:
    """torch's varlen FlashAttention, or None where this torch has none (< 2.10). Imported on first use
    (2 s of imports a CPU run never needs), then kept with its parameter names: every attention call of every
    layer asks, and an uncompiled step should not pay for an import lookup and a signature each time."""
    global _kernel, _kernel_parameters
    if _kernel is None:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            return None
        _kernel, _kernel_parameters = varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
    return _kernel


def unsupported_reason(model: PreTrainedModel, device: torch.device) -> str | None:
    """Why varlen attention cannot run `model` here, or None. The kernel is causal and plain: no sliding
    window, soft-capping, attention sinks or attention dropout, and (on CUDA) 16-bit activations. The attention's
    settings are read from the text config: a multimodal model's top config (Gemma 3 4B and up) has none of them,
    and its sliding-window layers passed as plain."""
    implementation = getattr(model.config, "_attn_implementation", None)
    config = model.config.get_text_config()
    if implementation not in ("sdpa", "eager", VARLEN_ATTENTION):
        return f"the model uses attn_implementation {implementation!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model has sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "the model soft-caps its attention logits"
    if any("sink" in name for name, _ in model.named_parameters()):
        return "the model's attention has sinks"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return "the model has attention dropout"
    if getattr(config, "output_router_logits", False):
        return "the router's load-balancing loss reads the padding mask"
    if device.type == "cuda":
        if varlen_kernel() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10 has)"
        if model.get_input_embeddings().weight.dtype not in (torch.bfloat16, torch.float16):
            return "the base is not bf16 or fp16 (FlashAttention computes in 16 bits)"
    return None


def choose_attention(setting: bool | str, model: PreTrainedModel, device: torch.device,
                     say: Callable[[str], None]) -> bool:  # fmt: skip
    """Turn varlen attention on for `model` where `setting` (`train.varlen_attention`) and the model allow;
    one log line says which attention the packed rows get. Returns whether varlen is on."""
    if setting is False or (setting == "auto" and device.type != "cuda"):
        why = "is false" if setting is False else "is auto, and varlen is for CUDA"
        say(f"attention: packed documents kept apart by a document mask (train.varlen_attention {why})")
        return False
    reason = unsupported_reason(model, device)
    if reason is not None:
        say(f"attention: varlen attention is off because {reason}; packed documents get a document mask")
        return False
    use_varlen_attention(model)
    kernel = (
        "torch's varlen FlashAttention" if device.type == "cuda" else "one SDPA per document (no varlen kernel here)"
    )
    say(f"attention: varlen, {kernel}, from the documents' boundaries (no mask)")
    return True


def use_varlen_attention(model: Any) -> PreTrainedModel:
    """Switch the transformers model inside `model` (a PeftModel, say) to varlen attention, in place."""
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN_ATTENTION, sdpa_mask)  # forwards without boundaries
    inner = transformers_model(model)
    if inner is None:
        raise TypeError(f"{type(model).__name__} holds no transformers model")
    inner.set_attn_implementation(VARLEN_ATTENTION)
    return inner


def boundary_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The model's keyword arguments for varlen attention: the boundaries and a 4D placeholder mask (see the
    module docstring) that keeps transformers from building a mask."""
    boundaries = batch["cu_seq_lens"]
    longest = batch["max_length"]
    placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
    return dict(
        attention_mask=placeholder, cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries,
        max_length_q=longest, max_length_k=longest,
    )  # fmt: skip


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (B, H, T, D), key and value (B, H_kv, T, D) ->
    ((B, T, H, D), None). Without boundaries in `kwargs`, transformers' SDPA with the mask it built."""
    boundaries = kwargs.get("cu_seq_lens_q")
    if boundaries is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)  # fmt: skip
    batch, heads, length, dim = query.shape
    flat_q, flat_k, flat_v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    dtype = flash_dtype(query)
    if query.device.type == "cuda" and varlen_kernel() is not None and dtype is not None:
        flat_q, flat_k, flat_v = (t.to(dtype) for t in (flat_q, flat_k, flat_v))
        out = _flash_varlen(flat_q, flat_k, flat_v, boundaries, int(kwargs["max_length_q"]), scaling)
    elif torch.compiler.is_compiling() or query.device.type == "cuda":
        return _masked_sdpa(query, key, value, boundaries, scaling), None
    else:
        out = _per_document_sdpa(flat_q, flat_k, flat_v, boundaries, scaling)
    return out.reshape(batch, length, heads, dim), None


def flash_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype FlashAttention computes `tensor` in: its own, or autocast's where it is float32 under
    autocast (a 4-bit base's layers run in float32 under bf16 autocast). SDPA gets that cast from autocast;
    torch's varlen op does not, and refused float32 ("FlashAttention only support fp16 and bf16", an H100).
    None where neither: the document mask is used instead."""
    sixteen_bit = (torch.bfloat16, torch.float16)
    if tensor.dtype in sixteen_bit:
        return tensor.dtype
    device = tensor.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in sixteen_bit:
        return torch.get_autocast_dtype(device)
    return None


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: torch.Tensor, longest: int,
                  scaling: float | None) -> torch.Tensor:  # fmt: skip
    """torch's kernel, whichever of its signatures this torch has: causal as `is_causal=True` (2.10, 2.11)
    or `window_size=(-1, 0)` (later); grouped-query heads as `enable_gqa` or repeated here."""
    kernel = varlen_kernel()
    assert kernel is not None
    parameters = _kernel_parameters
    options: dict[str, Any] = {"scale": scaling}
    if "is_causal" in parameters:
        options["is_causal"] = True
    else:
        options["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return kernel(q, k, v, boundaries, boundaries, longest, longest, **options)


def _masked_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, boundaries: torch.Tensor,
                 scaling: float | None) -> torch.Tensor:  # fmt: skip
    """The exact path inside `torch.compile` without the kernel: the document mask from the boundaries, on the
    device (reading them on the host, as the per-document loop does, would break the graph). (B, T, H, D)."""
    batch, _, length, _ = query.shape
    positions = torch.arange(batch * length, device=query.device)
    documents = torch.searchsorted(boundaries[1:], positions.to(boundaries.dtype), right=True).view(batch, length)
    mask = document_mask(documents)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])  # fmt: skip
    return out.transpose(1, 2)


def _per_document_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: torch.Tensor,
                       scaling: float | None) -> torch.Tensor:  # fmt: skip
    """The exact path where the kernel is missing: one causal SDPA per document. The boundaries are read on
    the host, so this is for the CPU (on a GPU it would wait on the device once per forward)."""
    edges = boundaries.tolist()
    grouped = k.shape[1] != q.shape[1]
    parts = []
    for start, end in zip(edges[:-1], edges[1:]):
        q_doc, k_doc, v_doc = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
        out = F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True, scale=scaling, enable_gqa=grouped)
        parts.append(out.transpose(0, 1))
    return torch.cat(parts)
