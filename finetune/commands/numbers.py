"""argparse types for the numbers the commands take: a bad value is argparse's one-line error (exit 2), before any
model loads, instead of a traceback or a silent nonsense result later (a batch of 0, a rank of -2, a temperature
of nan)."""

from __future__ import annotations

import argparse
import math


def _parsed(text: str, convert: type[int] | type[float], what: str) -> int | float:
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = int(_parsed(text, int, "a whole number"))
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    value = float(_parsed(text, float, "a number"))
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number of at least 0")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: checked before the models load, not when the server binds."""
    value = int(_parsed(text, int, "a port number"))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: give 1-65535, or 0 for any free one")
    return value
