"""The attention mask of a packed micro-batch, built on the device from document ids the collator computed.

Fed packed rows without a mask, transformers finds the documents from the restarts of `position_ids`
(`find_packed_sequence_indices`), and asks `(packed[:, -1] == 0).all()` on the host whether there are
several: on a GPU the host waits there, in every forward. An unpacked batch's 2D padding mask is read the
same way (whether any token is masked). The collator knows which document each position holds
(`document_index`, (R, T), -1 for padding), so the mask is built here instead, from tensors alone:

    mask[r, 0, q, k] = document[r, q] == document[r, k] and k <= q

a (R, 1, T, T) boolean for `sdpa` (True attends), additive (0 or the dtype's lowest) for `eager`, which adds
it to the scores. A 4D mask is used by transformers as given. Padding is a document of its own (positions
attend to padding only), so no row of the mask is empty. A model switched to varlen attention
(`finetune.training.varlen_attention`) gets the documents' boundaries instead of a mask. Other attention
implementations (flash attention, which reads the documents from `position_ids`) get the inputs unchanged.

Example:
    outputs = model(**model_inputs(model, batch), use_cache=False)
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from finetune.training.varlen_attention import VARLEN_ATTENTION, boundary_inputs

MASKED_IMPLEMENTATIONS = ("sdpa", "eager")


def model_inputs(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """The inputs of `model` for `batch`: ids and positions, and a 4D document mask (or the documents'
    boundaries, under varlen attention) where one applies."""
    inputs: dict[str, Any] = {key: batch[key] for key in ("input_ids", "position_ids") if key in batch}
    documents = batch.get("document_index")
    inner = _transformers_model(model)
    implementation = getattr(inner.config, "_attn_implementation", None) if inner is not None else None
    if implementation == VARLEN_ATTENTION and "cu_seq_lens" in batch:
        return inputs | boundary_inputs(batch, batch["input_ids"].device)
    # A mixture of experts returning its load-balancing loss reads `attention_mask` as the (R, T) padding mask
    # (transformers' `load_balancing_loss_func` flattens it per token): it keeps the position-ids path.
    router_loss = inner is not None and bool(getattr(inner.config, "output_router_logits", False))
    if documents is None or implementation not in MASKED_IMPLEMENTATIONS or router_loss:
        if "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs
    assert inner is not None
    mask = document_mask(documents)
    if implementation == "eager":
        dtype: torch.dtype = inner.get_input_embeddings().weight.dtype  # type: ignore[assignment]
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    inputs["attention_mask"] = mask
    return inputs


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """(R, T) document ids -> (R, 1, T, T) bool: a position attends to itself and earlier ones of its document."""
    length = documents.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril_()
    same = documents.unsqueeze(2) == documents.unsqueeze(1)  # (R, T, T)
    return (same & causal).unsqueeze(1)


def _transformers_model(model: Any) -> PreTrainedModel | None:
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    return None
