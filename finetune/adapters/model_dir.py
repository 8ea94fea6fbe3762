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
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

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


def write_shard(out_dir: Path, file_name: str, tensors: Mapping[str, torch.Tensor], ledger: Ledger) -> dict[str, str]:
    """Save one safetensors file with the ledger in its metadata; returns its part of the index's weight map.

    Tensors may live on a GPU (a model merged where it runs): each is copied to host memory to be written.
    """
    contiguous = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    save_file(contiguous, str(out_dir / file_name), metadata={"format": "pt", LEDGER_KEY: ledger.to_json()})
    return {name: file_name for name in tensors}


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
