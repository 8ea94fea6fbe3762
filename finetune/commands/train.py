"""`finetune train RECIPE [key=value ...] [--resume]` and `finetune validate RECIPE [key=value ...]`.

Example:
    finetune train recipes/quickstart.yaml train.lr=1e-3 --resume
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="fine-tune a LoRA adapter as a recipe says")
    train.add_argument("recipe", help="YAML recipe, e.g. recipes/quickstart.yaml")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. train.lr=1e-4")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of the run")
    train.set_defaults(handler=run_train)

    validate = subparsers.add_parser("validate", help="check a recipe (and overrides) without running it")
    validate.add_argument("recipe")
    validate.add_argument("overrides", nargs="*", metavar="key=value")
    validate.set_defaults(handler=run_validate)


def run_train(args: argparse.Namespace) -> int:
    from finetune.train import train

    adapter_dir, metrics = train(args.recipe, args.overrides, resume=args.resume)
    print(f"adapter: {adapter_dir}")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    from finetune.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    print(f"{args.recipe}: ok (adapter {recipe.output.adapter_dir}, {recipe.data.format} data, LoRA r={recipe.lora.r})")
    return 0
