"""The embedded base's pretraining corpus: the Python standard library's own source files.

Every Python installation carries a few megabytes of real, varied text (code, comments, docstrings)
that needs no download. The selection is deterministic: files are ordered by a hash of their path
relative to the standard library (a stable order that mixes packages, so a capped prefix is not all
`asyncio` or all `email`), each file contributes at most its first `max_file_bytes`, and files are taken
until `max_total_bytes` is reached. Tests and machine-specific files (`_sysconfigdata_*`, `config-*`)
are left out, so the corpus depends only on the Python version.

Example:
    corpus = stdlib_corpus(max_total_bytes=2_000_000, max_file_bytes=8_000)
    corpus.documents[0][:40], corpus.sha256
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import ModelError

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """Documents for pretraining, with what is needed to say where they came from."""

    documents: list[str]
    source: str
    num_files: int
    num_bytes: int
    sha256: str
    """Hash of the documents, so two builds can be checked to have read the same text."""


def _included(relative: Path) -> bool:
    if any(part in _EXCLUDED_DIRS or part.startswith("config-") for part in relative.parts[:-1]):
        return False
    return not relative.name.startswith("_sysconfigdata")


def _stable_order(relative: Path) -> str:
    return hashlib.sha256(relative.as_posix().encode("utf-8")).hexdigest()


def stdlib_corpus(max_total_bytes: int, max_file_bytes: int) -> Corpus:
    """Read the standard library's `.py` files, in a stable order, up to a size cap.

    Args:
        max_total_bytes: stop adding files once this many UTF-8 bytes are collected.
        max_file_bytes: keep at most this many bytes of each file (cut at a line end), so one huge
            module cannot dominate.

    Raises:
        ModelError: when the standard library has no readable sources (e.g. a zipped or .pyc-only
            install), with the directory that was searched.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    relatives = sorted(
        (path.relative_to(root) for path in root.rglob("*.py")),
        key=_stable_order,
    )
    documents: list[str] = []
    num_bytes = 0
    digest = hashlib.sha256()
    for relative in relatives:
        if num_bytes >= max_total_bytes:
            break
        if not _included(relative):
            continue
        try:
            text = (root / relative).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # a file in another encoding: skipping it keeps the corpus valid UTF-8
        data = text.encode("utf-8")[:max_file_bytes]
        text = data[: data.rfind(b"\n") + 1].decode("utf-8") if len(data) == max_file_bytes else text
        if not text.strip():
            continue
        documents.append(text)
        num_bytes += len(text.encode("utf-8"))
        digest.update(relative.as_posix().encode("utf-8") + b"\0" + text.encode("utf-8") + b"\0")
    if not documents:
        raise ModelError(
            f"no Python sources found under {root} to pretrain the embedded base on; "
            "install the standard library sources or set model.base to a local model directory"
        )
    return Corpus(
        documents=documents,
        source=f"python-stdlib {platform.python_version()} ({root})",
        num_files=len(documents),
        num_bytes=num_bytes,
        sha256=digest.hexdigest(),
    )
