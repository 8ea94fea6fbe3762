"""finetune: LoRA fine-tuning of causal language models, with exact adapter arithmetic.

Example:
    import finetune

    adapter_dir, metrics = finetune.train("recipes/quickstart.yaml", ["train.max_steps=20"])
    model = finetune.load_model(adapter_dir)   # the base from the adapter's manifest, the adapter in use
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetune.errors import AdapterError, DataError, FinetuneError, ModelError, RecipeError
from finetune.recipe import Recipe, load_recipe
from finetune.version import __version__

if TYPE_CHECKING:
    from finetune.api import load_model, train

__all__ = [
    "AdapterError",
    "DataError",
    "FinetuneError",
    "ModelError",
    "Recipe",
    "RecipeError",
    "__version__",
    "load_model",
    "load_recipe",
    "train",
]

_LAZY = {"load_model", "train"}
"""Names of `finetune.api` that load torch and transformers: imported on first use, so `import finetune`
(and the CLI's start) stays instant (PEP 562)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from finetune import api

        return getattr(api, name)
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
