"""The recipe catalog: recipes for the model families people fine-tune, shipped inside the package.

The YAML files live in `finetune/recipes/` (package data, so they work from any directory after
`pip install`; the repository's top-level `recipes/` points at the same folder). Wherever a command
takes a recipe path it also takes a catalog name: `finetune train llama-3.1-8b-instruct-chat` reads
`finetune/recipes/llama-3.1-8b-instruct-chat.yaml`. A path that exists always wins over a name.

It knows file names only, not what a recipe holds, so `finetune.recipe` can resolve names through it;
listing the catalog with each recipe's base and method is `finetune.commands.recipes`' job.

Example:
    catalog_names()[:2]                                 # ['gemma-2-2b-it-chat', 'gemma-2-9b-it-chat-qlora']
    resolve_recipe_path("qwen2.5-7b-instruct-chat")     # .../finetune/recipes/qwen2.5-7b-instruct-chat.yaml
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from finetune.atomic import atomic_file
from finetune.errors import RecipeError

CATALOG_DIR = Path(__file__).resolve().parent / "recipes"
RECIPE_SUFFIX = ".yaml"


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


def copy_recipe(name: str, destination: Path | str) -> Path:
    """Copy catalog recipe `name` to `destination` (a file, or a directory to put `<name>.yaml` in; a path written
    with a trailing `/` is a directory, made if missing)."""
    source = resolve_recipe_path(name)
    if not source.is_file() or source.parent != CATALOG_DIR:
        raise RecipeError(f"{name!r} is not a catalog recipe; see `finetune recipes list`")
    as_directory = str(destination).endswith(("/", os.sep))  # Path() drops the slash that says so
    destination = Path(destination)
    target = destination / source.name if as_directory or destination.is_dir() else destination
    hint = "choose another destination or delete it first"
    try:  # through a staging file: a full disk left an empty mine.yaml, which the next copy refused as existing
        with atomic_file(target, replace=False, error=RecipeError, hint=hint) as staging:
            shutil.copyfile(source, staging)
    except OSError as exc:
        raise RecipeError(f"cannot write {target}: {exc.strerror or exc}; choose another destination") from None
    return target
