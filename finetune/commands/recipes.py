"""`finetune recipes list|show|copy`: the recipe catalog shipped with the package (`finetune.catalog`).

Example:
    finetune recipes list --json
    finetune recipes copy llama-3.1-8b-instruct-chat my-recipe.yaml
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


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


def _method(quantization: str) -> str:
    return {"4bit": "qlora", "8bit": "lora-8bit"}.get(quantization, "lora")


def catalog_entries() -> list[CatalogEntry]:
    """Every catalog recipe, validated, sorted by name."""
    from finetune.catalog import CATALOG_DIR, RECIPE_SUFFIX, catalog_names
    from finetune.recipe import load_recipe  # here, not at the top: `finetune --help` stays fast

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


def register(subparsers: argparse._SubParsersAction) -> None:
    recipes = subparsers.add_parser("recipes", help="the recipe catalog: list, show, copy")
    actions = recipes.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="every catalog recipe: name, base, method, GPUs, memory")
    listing.add_argument("--json", action="store_true", help="a JSON array of objects (name, base, method, ...)")
    listing.set_defaults(handler=run_list)
    show = actions.add_parser("show", help="print a catalog recipe")
    show.add_argument("name")
    show.set_defaults(handler=run_show)
    copy = actions.add_parser("copy", help="copy a catalog recipe to edit as your own")
    copy.add_argument("name")
    copy.add_argument("destination", help="a .yaml path, or a directory")
    copy.set_defaults(handler=run_copy)


def run_list(args: argparse.Namespace) -> int:
    entries = catalog_entries()
    if args.json:
        print(json.dumps([entry.as_json() for entry in entries], indent=2))
        return 0
    rows = [("NAME", "BASE", "METHOD", "GPUS", "MEMORY")]
    rows += [(e.name, e.base, e.method, str(e.gpus or "-"), e.memory or "-") for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4])
    return 0


def run_show(args: argparse.Namespace) -> int:
    from finetune.catalog import resolve_recipe_path
    from finetune.errors import RecipeError

    path = resolve_recipe_path(args.name)
    if not path.is_file():
        raise RecipeError(f"no recipe file {path}; give a recipe file or a name from `finetune recipes list`")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # a file given by path may be anything: say so in one line
        raise RecipeError(f"recipe {path} cannot be read ({exc}); give a UTF-8 YAML recipe file") from None
    print(text, end="")
    return 0


def run_copy(args: argparse.Namespace) -> int:
    from finetune.catalog import copy_recipe

    target = copy_recipe(args.name, args.destination)
    print(f"copied {args.name} to {target}; edit it, then: finetune train {target}")
    return 0
