"""What a training forward is given for a collated micro-batch: ids, positions, and how documents are kept apart.

Fed packed rows without a mask, transformers finds the documents from the restarts of `position_ids`
(`find_packed_sequence_indices`), and asks `(packed[:, -1] == 0).all()` on the host whether there are
several: on a GPU the host waits there, in every forward. An unpacked batch's 2D padding mask is read the
same way (whether any token is masked). The collator knows which document each position holds, so the
forward gets one of two things built from it, neither of which asks the device anything:
- under varlen attention (`finetune.training.varlen_attention`), the documents' boundaries;
- under `sdpa` or `eager`, a 4D document mask (`finetune.training.document_mask`), which transformers uses
  as given.
Other attention implementations (flash attention, which reads the documents from `position_ids`) and a
mixture of experts returning its load-balancing loss (transformers' `load_balancing_loss_func` reads
`attention_mask` as the (R, T) padding mask) get the inputs unchanged.

Example:
    outputs = model(**model_inputs(model, batch), use_cache=False)
"""

from __future__ import annotations

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
        if "attention_mask" in batch:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs
    assert inner is not None
    mask = document_mask(documents)
    if implementation == "eager":
        dtype: torch.dtype = inner.get_input_embeddings().weight.dtype  # type: ignore[assignment]
        mask = additive(mask, dtype)
    inputs["attention_mask"] = mask
    return inputs
