"""The embedded bases shipped inside the package: where they are, and checking that they are whole.

A shipped base is a normal model directory under `finetune/embedded/base/<name>/` plus its build record
(`embedded.json`), which carries the sha256 of the weights and the tokenizer. Both the builder (which
writes them) and the cache (which uses them in place) read these few facts from here.

Example:
    check_shipped_base(shipped_base_dir("tiny-llama"))   # ModelError if a file's sha256 differs from the record
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from finetune.errors import ModelError

RECORD_FILE = "embedded.json"
FINGERPRINTED_FILES = ("model.safetensors", "tokenizer.json")
"""The files whose sha256 the build record carries: the weights and the tokenizer."""

SHIPPED_ROOT = Path(__file__).resolve().parent / "base"
"""Where the package carries its prebuilt embedded bases, one directory per name."""


def shipped_base_dir(name: str) -> Path:
    """The package directory of shipped base `name` (it may be absent, e.g. in a trimmed source tree)."""
    return SHIPPED_ROOT / name


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_shipped_base(path: Path) -> None:
    """Raise `ModelError` unless every file the build record fingerprints has that sha256.

    Catches a damaged install and a clone whose weights are a Git LFS pointer or were cut short, before
    `from_pretrained` fails with something less clear (or, worse, loads other weights).
    """
    recorded = json.loads((path / RECORD_FILE).read_text(encoding="utf-8")).get("sha256", {})
    for file_name, expected in recorded.items():
        actual = file_sha256(path / file_name) if (path / file_name).is_file() else "missing"
        if actual != expected:
            raise ModelError(
                f"the shipped embedded base {path} is damaged: {file_name} has sha256 {actual[:16]}, its build "
                f"record says {expected[:16]}; reinstall finetune, or rebuild it with python -m finetune.embedded.build"
            )
