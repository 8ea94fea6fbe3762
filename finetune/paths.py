"""Where finetune keeps its own caches: `$FINETUNE_HOME`, default `~/.cache/finetune`.

Example:
    finetune_home() / "embedded"       # built embedded bases
    finetune_home() / "fingerprints"   # cached weight fingerprints
"""

from __future__ import annotations

import os
from pathlib import Path


def finetune_home() -> Path:
    """`$FINETUNE_HOME` if set, else `~/.cache/finetune`."""
    home = os.environ.get("FINETUNE_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "finetune"
