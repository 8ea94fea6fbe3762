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
from typing import NoReturn

from finetune.console import configure_console
from finetune.errors import FinetuneError
from finetune.launched import broken_collective, end_if_launched, is_first_rank, say_once
from finetune.version import __version__

COMMAND_MODULES = ("train", "plan", "inference", "adapters", "recipes", "data", "serve", "export", "report")
"""Modules under `finetune.commands`, in the order their commands appear in `--help`."""

EXIT_USER_ERROR = 2


class _OneLineErrors(argparse.ArgumentParser):
    """argparse with the CLI's convention for bad input: one line, exit 2 (argparse prints its usage first, which
    for `finetune train` is four lines before the one that says what is wrong). Subcommand parsers inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"error: {self.prog}: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _OneLineErrors(
        prog="finetune", description="LoRA fine-tuning of causal LMs, with exact adapter arithmetic."
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="let the libraries underneath print their own logs and bars"
    )
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"finetune.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    try:
        try:
            return _run(argv)
        finally:  # SystemExit (`--help`) too: argparse's text waits in the buffer like a command's output
            sys.stdout.flush()
    except BrokenPipeError:  # `finetune ... | head`: the reader has gone; say nothing more
        # Flushed here, not in the interpreter's teardown: there the rest of an output past the buffer's 8 KiB
        # (`data preview --limit 20 | head -1`) met the closed pipe as "Exception ignored ... BrokenPipeError"
        # and exit 120, and so did all of a small one whose reader had gone (`| grep -q`, `| true`).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(argv: Sequence[str] | None) -> int:
    """Parse `argv` and run its command: user errors as one line, Ctrl-C as 130."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # `train R --nproc 2 k=v`: argparse stops collecting positionals at the first option
        if not hasattr(args, "overrides") or any(arg.startswith("-") or "=" not in arg for arg in extras):
            _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
        args.overrides = [*args.overrides, *extras]
    configure_console(verbose=args.verbose)
    try:
        return int(args.handler(args) or 0)
    except FinetuneError as exc:
        exit_code = getattr(exc, "exit_code", None)  # an interrupted run: 128 + the signal, the same on every rank
        if exit_code is None or is_first_rank():
            say_once(f"error: {exc}")  # once, though every rank of a launch finds the same fault
        return _ended(exit_code if exit_code is not None else EXIT_USER_ERROR)
    except KeyboardInterrupt:  # Ctrl-C before training's own handler: every rank of a launch gets it
        say_once("interrupted")
        return _ended(130)
    except Exception as exc:
        line = None if args.verbose else broken_collective(exc)
        if line is None:
            raise
        say_once(line)  # a rank whose peer failed: that rank's own error says why
        return _ended(1)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` ran, so that an argument it does not take is named with that command's
    `--help` (`finetune adapters info --help` lists its options; `finetune --help`, where the line sent users, only
    the commands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _command_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def _ended(code: int) -> int:
    """`code`; a launched rank ends with it at once (`end_if_launched`: a rank that had printed its one-line error
    died of SIGABRT now and then, exit 1 from the launcher instead of 2)."""
    end_if_launched(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
