"""The recipe catalog: recipes for the model families people fine-tune, shipped inside the package.

The YAML files live in `finetune/recipes/` (package data, so they work from any directory after
`pip install`; the repository's top-level `recipes/` points at the same folder). Wherever a command
takes a recipe path it also takes a catalog name: `finetune train llama-3.1-8b-instruct-chat` reads
`finetune/recipes/llama-3.1-8b-instruct-chat.yaml`. A path that exists always wins over a name.

Example:
    [entry.name for entry in catalog_entries()][:2]   # ['gemma-2-2b-it-chat', 'gemma-2-9b-it-chat-qlora']
    resolve_recipe_path("qwen2.5-7b-instruct-chat")     # .../finetune/recipes/qwen2.5-7b-instruct-chat.yaml
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import RecipeError

CATALOG_DIR = Path(__file__).resolve().parent / "recipes"
RECIPE_SUFFIX = ".yaml"


@dataclass(frozen=True)
class CatalogEntry:
    """One catalog recipe as `finetune recipes list` shows it."""

    name: str
    base: str
    method: str
    """`lora`, or `qlora` on a 4-bit base, `lora-8bit` on an 8-bit one."""
    gpus: int | None
    memory: str | None
    description: str
    path: Path

    def as_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def catalog_names() -> list[str]:
    return sorted(p.stem for p in CATALOG_DIR.glob(f"*{RECIPE_SUFFIX}"))


def resolve_recipe_path(text: str) -> Path:
    """The file for a recipe path or catalog name; a name that is neither suggests the closest catalog names."""
    path = Path(text)
    if path.exists() or path.suffix in (".yaml", ".yml") or "/" in text:
        return path
    candidate = CATALOG_DIR / f"{text}{RECIPE_SUFFIX}"
    if candidate.is_file():
        return candidate
    import difflib

    close = difflib.get_close_matches(text, catalog_names(), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise RecipeError(
        f"recipe {text!r} is neither a file nor a catalog recipe; {hint}see `finetune recipes list`, or give a path"
    )


def _method(quantization: str) -> str:
    return {"4bit": "qlora", "8bit": "lora-8bit"}.get(quantization, "lora")


def catalog_entries() -> list[CatalogEntry]:
    """Every catalog recipe, validated, sorted by name."""
    from finetune.recipe import load_recipe

    entries = []
    for name in catalog_names():
        path = CATALOG_DIR / f"{name}{RECIPE_SUFFIX}"
        recipe = load_recipe(path)
        entries.append(
            CatalogEntry(
                name=name,
                base=recipe.model.base,
                method=_method(recipe.model.quantization),
                gpus=recipe.catalog.gpus,
                memory=recipe.catalog.memory,
                description=recipe.description,
                path=path,
            )
        )
    return entries


def copy_recipe(name: str, destination: Path) -> Path:
    """Copy catalog recipe `name` to `destination` (a file, or a directory to put `<name>.yaml` in)."""
    source = resolve_recipe_path(name)
    if not source.is_file() or source.parent != CATALOG_DIR:
        raise RecipeError(f"{name!r} is not a catalog recipe; see `finetune recipes list`")
    target = destination / source.name if destination.is_dir() else destination
    if target.exists():
        raise RecipeError(f"{target} already exists; choose another destination or delete it first")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    return target
