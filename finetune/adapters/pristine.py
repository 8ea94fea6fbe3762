"""Where the untouched base weights come from when a merged tensor is recomputed.

Preferred source: the base's safetensors files, memory-mapped with `safe_open`, so exact restoration
costs no second copy of the model in memory (pages are read when a tensor is recomputed and can be
dropped by the OS afterwards). A tensor is taken from the files only if, cast to the model's dtype, it
equals the model's tensor at first touch (before anything is merged into it); otherwise (no files, a
hub model not in the local cache, a checkpoint whose names `from_pretrained` converts) a copy of that
tensor alone is kept in memory, and `copied_bytes` says how much that costs.

Example:
    pristine = PristineWeights("models/tiny")
    pristine.remember("model.layers.0.self_attn.q_proj.weight", current_tensor)   # at first touch
    base = pristine.get("model.layers.0.self_attn.q_proj.weight")                 # bit-equal to that tensor
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune.errors import AdapterWarning
from finetune.fingerprint import weight_files

if TYPE_CHECKING:
    from safetensors import safe_open


class PristineWeights:
    """Base tensors by checkpoint name, from memory-mapped files where possible, else from kept copies."""

    def __init__(self, base_dir: str | Path | None, *, verify: bool = True, aliases: dict[str, str] | None = None):
        """Args:
        base_dir: the base model's directory, or None when it has no files.
        verify: compare each file tensor with the model's at first touch; False when the model
            already holds merges (loaded from a merged checkpoint whose ledger names this base).
        aliases: name -> the name the files store its values under (tied weights: `lm_head.weight` ->
            `model.embed_tokens.weight`).
        """
        self._verify = verify
        self._aliases = dict(aliases or {})
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, safe_open] = {}
        self._copies: dict[str, torch.Tensor] = {}
        self._from_file: set[str] = set()
        if base_dir is not None and Path(base_dir).is_dir():
            self._index_files(Path(base_dir))

    def _index_files(self, base_dir: Path) -> None:
        index = base_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: base_dir / file for name, file in weight_map.items()}
            return
        from safetensors import safe_open

        for path in weight_files(base_dir):
            with safe_open(str(path), framework="pt") as handle:
                self._file_of.update({name: path for name in handle.keys()})

    @property
    def copied_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    def _read(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        if name not in self._file_of:
            name = self._aliases.get(name, name)
        path = self._file_of.get(name)
        if path is None:
            return None
        if path not in self._handles:
            from safetensors import safe_open

            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name).to(dtype)

    def remember(self, name: str, current: torch.Tensor) -> None:
        """Record the pristine value of `name` at its first touch: `current` must not hold any merge yet."""
        if name in self._from_file or name in self._copies:
            return
        from_file = self._read(name, current.dtype)
        if (
            from_file is not None
            and from_file.shape == current.shape
            and (not self._verify or torch.equal(from_file, current.detach().cpu()))
        ):
            self._from_file.add(name)
            return
        self._copies[name] = current.detach().clone()
        why = "it differs from the base files" if from_file is not None else "the base has no safetensors files here"
        warnings.warn(
            f"keeping an in-memory copy of {name} ({current.numel() * current.element_size() / 2**20:.1f} MiB) for exact "
            f"restoration because {why}",
            AdapterWarning,
            stacklevel=4,
        )

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The pristine tensor `name` (remembered before), in `dtype`."""
        if name in self._copies:
            return self._copies[name]
        assert name in self._from_file, f"{name} was never remembered"
        tensor = self._read(name, dtype)
        assert tensor is not None
        return tensor
