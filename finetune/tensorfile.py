"""Is a safetensors file whole? A header-only check, so truncated or corrupt files fail with a clear error.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the data. A file cut short by a full disk or a killed copy still opens (the
header is intact) and fails only when a missing tensor is read, deep inside a library, as a traceback.
Checking that the header parses and that the data ends exactly where the header says costs one small
read, whatever the file's size.

Example:
    check_safetensors(Path("adapters/legal/adapter_model.safetensors"), AdapterError, "re-save the adapter")
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from finetune.errors import FinetuneError

_HEADER_LENGTH_BYTES = 8
_MAX_HEADER_BYTES = 100 << 20  # safetensors itself refuses headers over 100 MB


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file at `path`, or None when its header and size agree."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(_HEADER_LENGTH_BYTES)
            if len(prefix) < _HEADER_LENGTH_BYTES:
                return f"it has {size} bytes, too short for a safetensors header"
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > min(_MAX_HEADER_BYTES, size - _HEADER_LENGTH_BYTES):
                return (
                    f"its header claims {header_length:,} bytes but the file has {size:,}: truncated or not safetensors"
                )
            header = json.loads(handle.read(header_length))
    except OSError as exc:
        return f"it cannot be read ({exc.strerror or exc})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid JSON: corrupt or not safetensors"
    if not isinstance(header, dict):
        return "its header is not a JSON object: corrupt or not safetensors"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__" and _is_entry(entry)]
    if len(ends) != len([k for k in header if k != "__metadata__"]):
        return "its header has malformed tensor entries: corrupt or not safetensors"
    expected = _HEADER_LENGTH_BYTES + header_length + max(ends, default=0)
    if size != expected:
        return f"it has {size:,} bytes but its header describes {expected:,}: truncated or corrupt"
    return None


def _is_entry(entry: object) -> bool:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)


def check_safetensors(path: Path, error: type[FinetuneError], fix: str) -> None:
    """Raise `error` naming `path`, the problem and `fix` when the file is not a whole safetensors file."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise error(f"{path}: {problem}; {fix}")
