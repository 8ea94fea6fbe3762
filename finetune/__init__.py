"""finetune: LoRA fine-tuning of causal language models, with exact adapter arithmetic.

Example:
    import finetune
    from finetune.training.loop import train

    adapter_dir, metrics = train("recipes/quickstart.yaml", ["train.max_steps=20"])
    model = finetune.load_model(adapter_dir)   # the base from the adapter's manifest, the adapter in use
"""

from __future__ import annotations

from finetune.api import load_model
from finetune.errors import AdapterError, DataError, FinetuneError, ModelError, RecipeError
from finetune.recipe import Recipe, load_recipe
from finetune.version import __version__

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
]
