"""finetune: LoRA fine-tuning of causal language models, with exact adapter arithmetic.

Example:
    import finetune
    adapter_dir, metrics = finetune.train("recipes/quickstart.yaml", ["train.max_steps=20"])
"""

from __future__ import annotations

__version__ = "0.1.0"

from finetune.api import load_model
from finetune.errors import AdapterError, DataError, FinetuneError, ModelError, RecipeError
from finetune.recipe import Recipe, load_recipe

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
