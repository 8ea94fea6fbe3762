"""The session's three adapters on the tiny base, shared by the adapter, API and CLI tests.

Example:
    def test_x(adapter_dirs): read_adapter(adapter_dirs["legal"])
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_adapter


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory, tiny_base_dir) -> dict[str, Path]:
    """Three adapters on the tiny base with overlapping targets, one rsLoRA, one with another rank and alpha."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "legal": make_adapter(tiny_base_dir, root / "legal", seed=1, targets=("q_proj", "v_proj")),
        "med": make_adapter(
            tiny_base_dir, root / "med", seed=2, targets=("q_proj", "o_proj", "down_proj"), r=8, alpha=16
        ),
        "code": make_adapter(
            tiny_base_dir, root / "code", seed=3, targets=("v_proj", "up_proj"), r=2, alpha=4, use_rslora=True
        ),
    }
