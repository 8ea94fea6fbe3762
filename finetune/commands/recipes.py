"""`finetune recipes list|show|copy`: the recipe catalog shipped with the package (`finetune.catalog`).

Example:
    finetune recipes list --json
    finetune recipes copy llama-3.1-8b-instruct-chat my-recipe.yaml
"""

from __future__ import annotations

import argparse
import json


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
    from finetune.catalog import catalog_entries

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

    print(resolve_recipe_path(args.name).read_text(encoding="utf-8"), end="")
    return 0


def run_copy(args: argparse.Namespace) -> int:
    from pathlib import Path

    from finetune.catalog import copy_recipe

    target = copy_recipe(args.name, Path(args.destination))
    print(f"copied {args.name} to {target}; edit it, then: finetune train {target}")
    return 0
