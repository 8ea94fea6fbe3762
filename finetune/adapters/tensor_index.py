"""Which safetensors file of a model directory holds each tensor, with its dtype and shape, from headers alone.

The one index of a checkpoint's tensors: the on-disk arithmetic streams by it, the pristine-weights
provider reads base tensors through it, the GGUF export plans by it, requantization finds dense weights
with it. Reading a header costs no tensor data, so indexing a 140 GB checkpoint takes milliseconds per file.

Example:
    index = TensorIndex.of("models/tiny")
    header = index["model.layers.0.self_attn.q_proj.weight"]   # TensorHeader(file=..., dtype='BF16', shape=(64, 64))
    header.torch_dtype                                            # torch.bfloat16
    tensor = index.read("model.layers.0.self_attn.q_proj.weight")
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from finetune.fingerprint import weight_files

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors' dtype codes -> torch dtypes (those transformers checkpoints hold)."""


class TensorHeader(NamedTuple):
    """Where one tensor lives and what it is, as its file's header says."""

    file: Path
    dtype: str
    """safetensors' code: F32, BF16, F16, ..."""
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return SAFETENSORS_DTYPES.get(self.dtype)


class TensorIndex(Mapping[str, TensorHeader]):
    """name -> `TensorHeader` for every tensor of a model directory; `read` opens files memory-mapped, once each."""

    def __init__(self, headers: dict[str, TensorHeader]):
        self._headers = headers
        self._handles: dict[Path, Any] = {}

    @classmethod
    def of(cls, model_dir: str | Path) -> TensorIndex:
        """The index of `model_dir`'s `*.safetensors` files (empty when it has none)."""
        from safetensors import safe_open

        headers = {}
        for path in weight_files(model_dir):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensor_slice = handle.get_slice(name)
                    headers[name] = TensorHeader(path, tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
        return cls(headers)

    def __getitem__(self, name: str) -> TensorHeader:
        return self._headers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers)

    def __len__(self) -> int:
        return len(self._headers)

    @property
    def files(self) -> list[Path]:
        """The files holding tensors, sorted by name."""
        return sorted({header.file for header in self._headers.values()})

    def names_in(self, file: Path) -> list[str]:
        """The tensors of one file, in the file's order."""
        return [name for name, header in self._headers.items() if header.file == file]

    def single_dtype(self) -> torch.dtype | None:
        """The floating dtype every floating tensor shares, or None if they differ."""
        dtypes = {h.torch_dtype for h in self._headers.values() if h.torch_dtype is not None}
        floating = {dtype for dtype in dtypes if dtype.is_floating_point}
        return floating.pop() if len(floating) == 1 else None

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` as stored (pages are read on access and can be dropped by the OS afterwards)."""
        file = self._headers[name].file
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file].get_tensor(name)

    def release(self, file: Path) -> None:
        """Close `file`'s handle, unmapping its pages (a later `read` opens it again): a streaming merge calls it
        after each shard, so the process maps one input shard at a time, not the checkpoint."""
        self._handles.pop(file, None)
