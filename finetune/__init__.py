"""finetune: LoRA fine-tuning of causal language models, with exact adapter arithmetic.

Example:
    import finetune

    adapter_dir, metrics = finetune.train("recipes/quickstart.yaml", ["train.max_steps=20"])
    model = finetune.load_model(adapter_dir)   # the base from the adapter's manifest, the adapter in use
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from finetune.errors import AdapterError, DataError, FinetuneError, ModelError, RecipeError
from finetune.version import __version__

if TYPE_CHECKING:
    from finetune.api import load_model
    from finetune.recipe import Recipe, load_recipe
    from finetune.training.loop import train

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

_LAZY = {
    "load_model": "finetune.api",
    "train": "finetune.training.loop",
    "Recipe": "finetune.recipe",
    "load_recipe": "finetune.recipe",
}
"""Names imported on first use, with the module defining each (PEP 562): `load_model` and `train` load torch
and transformers, and `load_model` never pulls in the training stack that `train` needs; the recipe schema
costs pydantic's import and its schema build (a quarter of a second), which `finetune --help` and the
commands that read no recipe should not pay."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the lazy ones (PEP 562): `dir(finetune)`, and so a notebook's tab completion of
    `finetune.`, listed neither `train` nor `load_model` until each had been used once."""
    return sorted(set(globals()) | set(_LAZY))
