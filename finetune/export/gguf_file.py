"""Writing one GGUF file: tensor encodings (f32, f16, bf16, q8_0), streamed one tensor at a time, atomically.

The tensor list is planned first (names, shapes, encodings: the header needs every size up front),
then each tensor is loaded, encoded and written in turn, so peak memory is about one tensor, not the
model. The file is written beside `out` and renamed into place at the end (`finetune.atomic`): an
interrupted export leaves nothing at `out`.

Example:
    plan = [PlannedTensor("token_embd.weight", (2048, 128), "f16", load_embeddings)]
    write_gguf(Path("model.gguf"), "llama", lambda writer: writer.add_name("tiny"), plan)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from finetune.atomic import atomic_file
from finetune.errors import ExportError

DTYPES = ("f32", "f16", "bf16", "q8_0")
"""Encodings `--dtype` accepts for 2-D weights; 1-D tensors (norms, biases) are always f32, as llama.cpp wants."""


def _qtype(dtype: str):
    import gguf

    return {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
    }[dtype]


def file_type(dtype: str) -> int:
    """`general.file_type` (llama.cpp's llama_ftype) of a file whose weights are mostly `dtype`."""
    import gguf

    return {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[dtype]


def tensor_dtype(shape: Sequence[int], requested: str) -> str:
    """The encoding a tensor of `shape` gets when `requested` for the weights.

    1-D tensors stay f32. q8_0 packs blocks of 32 along a row; rows of another length fall back to f16
    (what llama.cpp's own converter does).
    """
    if len(shape) < 2:
        return "f32"
    if requested == "q8_0" and shape[-1] % 32 != 0:
        return "f16"
    return requested


class _WrittenByPython(np.ndarray):
    """An array whose `tofile` (what `GGUFWriter.write_tensor_data` calls) goes through the file object's `write`.

    numpy's `tofile` reports a write cut short by a full disk or a file-size limit as "N requested and M
    written", an OSError without errno, so `atomic_file` could not say the disk was full and the export ended
    in a traceback (exit 1); Python's `write` raises the same failure with its errno (ENOSPC, EFBIG).
    """

    def tofile(self, fid, *args, **kwargs) -> None:
        fid.write(np.ascontiguousarray(self).reshape(-1).view(np.uint8).data)


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the file: its GGUF name, its shape (numpy order: rows first), encoding and loader."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    load: Callable[[], np.ndarray]
    """Returns the tensor as float32, already in llama.cpp's layout; called once, while writing."""


def _encoded_shape(shape: tuple[int, ...], dtype: str) -> tuple[tuple[int, ...], np.dtype]:
    import gguf

    if dtype == "f32":
        return shape, np.dtype(np.float32)
    if dtype == "f16":
        return shape, np.dtype(np.float16)
    return tuple(gguf.quant_shape_to_byte_shape(shape, _qtype(dtype))), np.dtype(np.uint8)


def encode(array: np.ndarray, dtype: str) -> np.ndarray:
    """`array` (float32) in the bytes GGUF stores for `dtype`."""
    import gguf

    if dtype == "f32":
        return np.ascontiguousarray(array, dtype=np.float32)
    if dtype == "f16":
        return np.ascontiguousarray(array, dtype=np.float16)
    return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), _qtype(dtype))


def write_gguf(
    out: str | Path, arch: str, add_metadata: Callable[[Any], None], tensors: Sequence[PlannedTensor]
) -> Path:
    """Write a GGUF file: `add_metadata(writer)` fills the key-value section, then `tensors` are streamed.

    Raises:
        ExportError: `out` exists already, or cannot be written (disk full, permissions).
    """
    import gguf

    out = Path(out)
    hint = "choose another --out or delete it first"
    with atomic_file(out, replace=False, error=ExportError, hint=hint) as staging:
        writer = gguf.GGUFWriter(path=None, arch=arch)
        try:
            add_metadata(writer)
            for tensor in tensors:
                shape, numpy_dtype = _encoded_shape(tensor.shape, tensor.dtype)
                nbytes = math.prod(shape) * numpy_dtype.itemsize
                writer.add_tensor_info(tensor.name, shape, numpy_dtype, nbytes, raw_dtype=_qtype(tensor.dtype))
            writer.write_header_to_file(path=staging)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for tensor in tensors:
                data = tensor.load()
                assert tuple(data.shape) == tensor.shape, (tensor.name, data.shape, tensor.shape)
                writer.write_tensor_data(encode(data, tensor.dtype).view(_WrittenByPython))
        finally:
            writer.close()
    return out
