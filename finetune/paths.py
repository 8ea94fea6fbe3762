"""Where finetune keeps its own caches: `$FINETUNE_HOME`, default `~/.cache/finetune`.

It also answers where a model's files are on this machine: a local directory is itself, a hub id is its
snapshot in the local hub cache, found without touching the network.

Example:
    finetune_home() / "embedded"       # built embedded bases
    finetune_home() / "fingerprints"   # cached weight fingerprints
    local_model_dir("meta-llama/Llama-3.2-1B")   # its snapshot directory if cached, else None
"""

from __future__ import annotations

import os
from pathlib import Path


def finetune_home() -> Path:
    """`$FINETUNE_HOME` if set, else `~/.cache/finetune`."""
    home = os.environ.get("FINETUNE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "finetune"


def local_model_dir(source: str, revision: str | None = None) -> Path | None:
    """The local directory holding `source`'s files: itself, or its hub-cache snapshot; None if neither."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, or not cached (huggingface_hub raises several types for these)
        return None
