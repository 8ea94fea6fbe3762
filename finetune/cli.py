"""The `finetune` command: parses arguments, dispatches to `finetune.commands.*`, turns user errors into one line.

Each command group lives in its own module under `finetune/commands/` exposing `register(subparsers)`,
which adds its parser(s) and sets `handler` (a function of the parsed args returning an exit code).
Heavy libraries (torch, transformers) are imported inside handlers, so `finetune --help` is instant.

Example:
    finetune train recipes/quickstart.yaml train.max_steps=50
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from finetune.errors import FinetuneError

COMMAND_MODULES = ("train", "inference", "adapters", "export", "report")
"""Modules under `finetune.commands`, in the order their commands appear in `--help`."""

EXIT_USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="finetune", description="LoRA fine-tuning of causal LMs, with exact adapter arithmetic."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"finetune.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except FinetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
