"""`warnings_as_lines`: a command's own warnings (`FinetuneWarning`: adapters, rewards) printed as one
`warning: ...` line each, like its errors, instead of Python's `file:line: AdapterWarning: ...` and the source
line that raised it."""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from collections.abc import Callable

from finetune.errors import FinetuneWarning


def warnings_as_lines(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print `FinetuneWarning`s as one `warning: ...` line each (like errors), other warnings as usual."""

    @functools.wraps(handler)
    def wrapped(args: argparse.Namespace) -> int:
        default_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, FinetuneWarning):
                print(f"warning: {message}", file=sys.stderr)
            else:
                default_show(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.filterwarnings("default", category=FinetuneWarning)  # part of the output, like errors
            warnings.showwarning = show
            return handler(args)

    return wrapped
