"""Tied weights (one tensor serving as input embeddings and output head) under adapter arithmetic.

A model with `tie_word_embeddings` stores one matrix for `model.embed_tokens.weight` and `lm_head.weight`.
An adapter's update to one of them is the update of that layer alone: unmerged, peft adds the head's
LoRA to the head's output and leaves the embeddings as they were. A merge must keep that meaning, so it
unties the pair: the touched name gets a tensor of its own, the other keeps the shared one, and the
files then hold both names with `tie_word_embeddings: false`. Once neither name holds an update, the
pair is tied again, so subtracting everything gives the base back in structure as well as in bits.

Example:
    tied_parameter_names(model)             # {'lm_head.weight': 'model.embed_tokens.weight', ...}
    stored_aliases(meta_model, stored_names)  # {'lm_head.weight': 'model.embed_tokens.weight'}
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TIE_KEY = "tie_word_embeddings"


def tied_parameter_names(model: torch.nn.Module) -> dict[str, str]:
    """parameter name -> another name sharing its storage, for every tied parameter (peft wrappers seen through)."""
    names_by_id: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(parameter), []).append(name.replace(".base_layer", ""))
    tied: dict[str, str] = {}
    for names in names_by_id.values():
        for name in names if len(names) > 1 else []:
            tied[name] = next(other for other in names if other != name)
    return tied


def stored_aliases(architecture: PreTrainedModel, stored_names: Collection[str]) -> dict[str, str]:
    """Tied weight names the checkpoint does not store -> the stored name holding their values.

    `architecture` is the model built from the checkpoint's config (on the meta device: nothing is
    allocated); tied as transformers ties it on load. Empty when nothing is tied.
    """
    architecture.tie_weights()
    return {
        name: other
        for name, other in tied_parameter_names(architecture).items()
        if name not in stored_names and other in stored_names
    }
