"""Writing model directories atomically: staging dir, shards with the ledger in their metadata, index, config.

Every writer builds its output in `.<out>.partial-<pid>` beside `--out` and renames it into place only
when everything is written, so a killed or failed run leaves no directory at `--out` (a stale
`.partial-*` directory may remain and is safe to delete).

Example:
    with staging_dir("merged/legal") as tmp:
        weight_map = write_shard(tmp, "model.safetensors", tensors, ledger)
        write_index(tmp, weight_map, total_bytes)           # only when there are several shards
        write_config(tmp, config_dict, ledger, dtype=torch.bfloat16)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.adapters.ledger import LEDGER_KEY, Ledger
from finetune.atomic import atomic_directory
from finetune.errors import AdapterError

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".index.json")
# A test hook: seconds to sleep after each shard, so a test can kill a merge half-way.
SLOW_HOOK_ENV = "FINETUNE_TEST_SECONDS_PER_SHARD"


_OUT_HINT = "choose another --out or delete it first"


def ensure_free(out: str | Path) -> Path:
    out = Path(out)
    if out.exists():
        raise AdapterError(f"{out} already exists; {_OUT_HINT}")
    return out


def staging_dir(out: str | Path) -> contextlib.AbstractContextManager[Path]:
    """A temporary directory that becomes `out` when the block finishes (`finetune.atomic`); `out` must be free."""
    return atomic_directory(Path(out), error=AdapterError, hint=_OUT_HINT)


def after_shard_hook() -> None:
    seconds = float(os.environ.get(SLOW_HOOK_ENV, "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of a shard to be written: its name, dtype and shape, known before its values are."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


def write_shard(out_dir: Path, file_name: str, tensors: Mapping[str, torch.Tensor], ledger: Ledger) -> dict[str, str]:
    """Save one safetensors file with the ledger in its metadata; returns its part of the index's weight map.

    Tensors may live on a GPU (a model merged where it runs): each is copied to host memory as it is written.
    """
    planned = [PlannedTensor(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    return write_planned_shard(out_dir, file_name, planned, lambda entry: tensors[entry.name], ledger)


def write_planned_shard(
    out_dir: Path,
    file_name: str,
    planned: list[PlannedTensor],
    produce: Callable[[PlannedTensor], torch.Tensor],
    ledger: Ledger,
) -> dict[str, str]:
    """Write a safetensors file whose tensors are computed (`produce`) one at a time, as they are written.

    The header (names, dtypes, shapes, offsets) is written first, from `planned`; then each tensor in turn, so
    a merge holds one tensor of the shard rather than all of them (safetensors' `save_file` needs the whole
    dict). The layout is safetensors' own: 8-byte little-endian header length, the JSON header padded with
    spaces to a multiple of 8, the data with tensors ordered by element size (largest first), then name, so
    each is aligned to its element size; `safe_open` and `from_pretrained` read it as any other.
    """
    order = sorted(planned, key=lambda entry: (-entry.dtype.itemsize, entry.name))
    header: dict[str, object] = {"__metadata__": {"format": "pt", LEDGER_KEY: ledger.to_json()}}
    offset = 0
    for entry in order:
        header[entry.name] = {
            "dtype": _SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape), "data_offsets": [offset, offset + entry.nbytes],
        }  # fmt: skip
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(out_dir / file_name, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for entry in order:
            tensor = produce(entry).detach()
            if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                raise ValueError(
                    f"{entry.name}: computed {tensor.dtype} {tuple(tensor.shape)}, planned {entry.dtype} {entry.shape}"
                )
            if tensor.numel():
                file.write(tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor
    return {entry.name: file_name for entry in planned}


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64",
}  # fmt: skip
"""torch dtype -> its name in a safetensors header (the format's specification)."""


def write_index(out_dir: Path, weight_map: Mapping[str, str], total_bytes: int) -> None:
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def write_config(out_dir: Path, config: dict, ledger: Ledger, dtype: torch.dtype | None) -> None:
    """config.json with the ledger under `finetune_merged`; a merged model is never quantized."""
    config = dict(config)
    config.pop("quantization_config", None)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.pop("torch_dtype", None)
    config[LEDGER_KEY] = json.loads(ledger.to_json())
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_side_files(source_dir: Path, out_dir: Path) -> None:
    """Copy tokenizer, generation config, chat template, README...: everything but weights and config.json."""
    for path in sorted(Path(source_dir).iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)


def shard_file_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
