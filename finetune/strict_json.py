"""JSON that every reader takes: a float that is not finite is written as null; and read JSON that is not text.

Python's `json` writes NaN and Infinity, which JSON has no word for, and jq, JavaScript's `JSON.parse` and most
readers outside Python then refuse the whole line. A training step skipped for a non-finite loss, or a
perplexity beyond float range, is what would put them into metrics.jsonl or a manifest.

The other way round, `json.loads` takes an escaped UTF-16 surrogate without its pair (`"\\ud83d"`, left by text
cut inside an emoji), which gives a string that is not text: `is_text` says so before a tokenizer fails on it.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float in it (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps` of `value` with non-finite floats as null (and a ValueError should anything else be one)."""
    return json.dumps(finite_or_null(value), allow_nan=False, **options)


def is_text(value: Any) -> bool:
    """Whether every string in `value` (data `json.loads` returned) is text: none holds a lone surrogate, which
    UTF-8 cannot encode and a tokenizer refuses (a TypeError deep inside it)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
