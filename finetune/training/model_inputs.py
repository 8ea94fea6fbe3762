"""What a training forward is given for a collated micro-batch: ids, positions, and how documents are kept apart.

Fed packed rows without a mask, transformers finds the documents from the restarts of `position_ids`
(`find_packed_sequence_indices`), and asks `(packed[:, -1] == 0).all()` on the host whether there are
several: on a GPU the host waits there, in every forward. An unpacked batch's 2D padding mask is read the
same way (whether any token is masked). The collator knows which document each position holds, so the
forward gets one of two things built from it, neither of which asks the device anything:
- under varlen attention (`finetune.training.varlen_attention`), the documents' boundaries;
- under `sdpa` or `eager`, a 4D document mask (`finetune.training.document_mask`), which transformers uses
  as given, for every layer: so sliding-window layers get it with their window (`layer_windows`), and a
  family mixing sliding and full layers (Gemma 2/3, gpt-oss, Qwen2 with `use_sliding_window`) gets one mask
  per layer type, the `{layer_type: mask}` mapping its forward takes in place of the masks it would build.
  A layer type other than full and sliding attention (chunked, linear) gets the inputs unchanged.
Other attention implementations (flash attention, which reads the documents from `position_ids`) and a
mixture of experts returning its load-balancing loss (transformers' `load_balancing_loss_func` reads
`attention_mask` as the (R, T) padding mask) get the inputs unchanged.

Example:
    outputs = model(**model_inputs(model, batch), use_cache=False)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from finetune.scoring import transformers_model
from finetune.training.document_mask import additive, document_mask
from finetune.training.varlen_attention import VARLEN_ATTENTION, boundary_inputs

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


def model_inputs(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """The inputs of `model` for `batch`: ids and positions, and the documents' boundaries or a 4D document
    mask where one applies (see the module docstring)."""
    inputs: dict[str, Any] = {key: batch[key] for key in ("input_ids", "position_ids") if key in batch}
    documents = batch.get("document_index")
    inner = transformers_model(model)
    implementation = getattr(inner.config, "_attn_implementation", None) if inner is not None else None
    if implementation == VARLEN_ATTENTION and "cu_seq_lens" in batch:
        return inputs | boundary_inputs(batch, batch["input_ids"].device)
    router_loss = inner is not None and bool(getattr(inner.config, "output_router_logits", False))
    if documents is None or implementation not in MASKED_IMPLEMENTATIONS or router_loss:
        return _unchanged(batch, inputs)
    assert inner is not None
    windows = layer_windows(inner)
    if windows is None:
        return _unchanged(batch, inputs)
    dtype: torch.dtype = inner.get_input_embeddings().weight.dtype  # type: ignore[assignment]
    masks: dict[int | None, torch.Tensor] = {}
    for window in set(windows.values()):
        mask = document_mask(documents, window)
        masks[window] = additive(mask, dtype) if implementation == "eager" else mask
    if len(masks) == 1:
        inputs["attention_mask"] = next(iter(masks.values()))
    else:
        inputs["attention_mask"] = {layer_type: masks[window] for layer_type, window in windows.items()}
    return inputs


def _unchanged(batch: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` with the batch's own 2D padding mask, if any: transformers builds the masks itself."""
    if "attention_mask" in batch:
        inputs["attention_mask"] = batch["attention_mask"]
    return inputs


def layer_windows(model: Any) -> dict[str, int | None] | None:
    """The sliding window of each layer type of a transformers `model` (None: full attention), as its forward
    applies them; None where it has a layer type this does not know. Without `layer_types`, every layer of a
    model whose modeling module builds sliding masks (Mistral, Mixtral, Phi-3) uses `config.sliding_window`."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        module = sys.modules.get(type(model).__module__)
        slides = module is not None and hasattr(module, "create_sliding_window_causal_mask")
        return {"full_attention": window if slides else None}
    if not set(layer_types) <= {"full_attention", "sliding_attention"}:
        return None
    return {kind: window if kind == "sliding_attention" else None for kind in set(layer_types)}
