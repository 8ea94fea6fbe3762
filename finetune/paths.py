"""Where files live: finetune's own caches (`$FINETUNE_HOME`, default `~/.cache/finetune`) and the local
directory of a base model named by path or hub id.

Example:
    finetune_home() / "embedded"       # built embedded bases
    finetune_home() / "fingerprints"   # cached weight fingerprints
    local_model_dir("meta-llama/Llama-3.2-1B")   # its hub-cache snapshot, or None when not downloaded
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
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, or not cached: no files to read a pristine copy from
        return None
