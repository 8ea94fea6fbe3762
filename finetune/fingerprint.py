"""Fingerprints of base-model weights: one `sha256:<hex>` string per set of tensors, whatever the layout.

An adapter records the fingerprint of the base it was trained on; applying it to another base is refused
unless forced (`finetune.adapters.fit.check_fingerprint`). The fingerprint covers content only: for every tensor, sorted by name, its name, dtype,
shape and the sha256 of its raw bytes. Sharding, file names, safetensors metadata and the order of
tensors in a file do not change it, so a model and the directory it was loaded from agree:

- tied weights (`tie_word_embeddings`): the model's `state_dict` holds `lm_head.weight` as an alias of
  the embedding, the file holds the embedding once; aliases are counted once, under the first name in
  `state_dict` order (the name `save_pretrained` keeps);
- peft-wrapped models: the base weights are fingerprinted (`...q_proj.base_layer.weight` counts as
  `...q_proj.weight`), the LoRA weights are not;
- a model loaded in another dtype than its files (or quantized) has different bytes, so a different
  fingerprint: fingerprint the directory in that case (`fingerprint_model` does so itself for
  bitsandbytes-quantized models whose directory is known).

Directory results are cached per safetensors file, keyed by (absolute path, size, mtime_ns), in memory
and under `$FINETUNE_HOME/fingerprints` (default `~/.cache/finetune`), so a 10 GB base is hashed once.

Example:
    fingerprint_model_dir("models/tiny")      # 'sha256:3f0c...'
    fingerprint_model(model) == fingerprint_model_dir("models/tiny")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.paths import finetune_home

if TYPE_CHECKING:
    import torch

PREFIX = "sha256:"
_BYTES_PER_READ = 64 << 20  # hash big tensors in slices of rows so no tensor is copied whole
_memory_cache: dict[tuple[str, int, int], dict[str, list]] = {}

# peft's wrappers: the base weight of a LoRA layer, and the original of a `modules_to_save` module.
_PEFT_BASE_NAME = re.compile(r"(?:\.(?:base_layer|original_module))+\.")  # nested: one wrapper per expert tensor


def _cache_dir() -> Path:
    return finetune_home() / "fingerprints"


def _tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes in row-major order, reading at most ~64 MB at a time."""
    import torch

    digest = hashlib.sha256()
    tensor = tensor.detach()
    if tensor.dim() == 0 or tensor.numel() * tensor.element_size() <= _BYTES_PER_READ:
        whole = tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        digest.update(whole)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ for Python >= 3.12 only
        return digest.hexdigest()
    bytes_per_row = tensor[0].numel() * tensor.element_size()
    rows_per_read = max(1, _BYTES_PER_READ // max(1, bytes_per_row))
    for start in range(0, tensor.shape[0], rows_per_read):
        chunk = tensor[start : start + rows_per_read].contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        digest.update(chunk)  # type: ignore[arg-type]  # as above
    return digest.hexdigest()


def _entry(tensor: torch.Tensor) -> list:
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), _tensor_digest(tensor)]


def _combine(entries: dict[str, list]) -> str:
    """The fingerprint of {name: [dtype, shape, digest]}: independent of insertion order and sharding."""
    digest = hashlib.sha256()
    for name in sorted(entries):
        dtype, shape, tensor_digest = entries[name]
        digest.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{tensor_digest}\n".encode())
    return PREFIX + digest.hexdigest()


def _file_entries(path: Path) -> dict[str, list]:
    """Per-tensor entries of one safetensors file, from the cache when its path, size and mtime match."""
    from safetensors import safe_open

    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _memory_cache:
        return _memory_cache[key]
    cache_file = _cache_dir() / (hashlib.sha256(repr(key).encode()).hexdigest() + ".json")
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("key") == list(key):
            _memory_cache[key] = cached["entries"]
            return cached["entries"]
    except (OSError, ValueError):
        pass
    entries: dict[str, list] = {}
    with safe_open(str(path), framework="pt") as handle:  # memory-mapped: one tensor resident at a time
        for name in handle.keys():
            entries[name] = _entry(handle.get_tensor(name))
    _memory_cache[key] = entries
    tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"key": list(key), "entries": entries}))
        tmp.replace(cache_file)
    except OSError:  # a read-only home only costs re-hashing next time; a full one left the part written
        with contextlib.suppress(OSError):  # (on a read-only home nothing was written)
            tmp.unlink(missing_ok=True)
    return entries


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files holding a model directory's weights (all shards), sorted by name."""
    return sorted(Path(model_dir).glob("*.safetensors"))


def fingerprint_model_dir(model_dir: str | os.PathLike) -> str:
    """Fingerprint of the weights stored in a model directory's safetensors files.

    Args:
        model_dir: a directory written by `save_pretrained` (single file or shards).

    Raises:
        FileNotFoundError: the directory holds no `*.safetensors` file.
    """
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights to fingerprint")
    entries: dict[str, list] = {}
    for path in files:
        if path.name == "adapter_model.safetensors":
            continue
        entries.update(_file_entries(path))
    return _combine(entries)


def _is_quantized(model) -> bool:
    return bool(
        getattr(model, "is_quantized", False) or getattr(getattr(model, "config", None), "quantization_config", None)
    )


def base_state_items(model) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of a model's base weights as `save_pretrained` names them.

    Unwraps a peft model (LoRA weights dropped, `base_layer.` removed) and counts tied weights once.
    Tensors transformers fuses at load time (mixture-of-experts' stacked experts) are split back as it
    saves them (`revert_weight_conversion`: one tensor per expert for most families).
    """
    inner = model
    if hasattr(inner, "get_base_model"):  # PeftModel
        inner = inner.get_base_model()
    items: list[tuple[str, torch.Tensor]] = []
    seen: set[tuple[int, int, tuple]] = set()
    for name, tensor in inner.state_dict(keep_vars=False).items():
        if ".lora_" in name or ".modules_to_save." in name or name.startswith("lora_"):
            continue
        name = _PEFT_BASE_NAME.sub(".", name)
        if tensor.device.type != "meta" and tensor.numel() > 0:
            identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if identity in seen:
                continue  # an alias of a tensor already counted (tied embeddings)
            seen.add(identity)
        items.append((name, tensor))
    if any(tensor.dim() == 3 for _, tensor in items):
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(inner, dict(items)).items())
    return items


def fingerprint_model(model) -> str:
    """Fingerprint of an in-memory model's base weights, equal to that of the directory it came from.

    A bitsandbytes-quantized model holds other bytes than its files; it is fingerprinted through the
    directory recorded in `model.config._name_or_path` when that exists, else this raises `ValueError`.
    """
    if _is_quantized(model):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        source = getattr(inner.config, "_name_or_path", "") or getattr(inner, "name_or_path", "")
        if source and weight_files(source):
            return fingerprint_model_dir(source)
        raise ValueError("a quantized model's bytes are not its base's: fingerprint the directory it was loaded from")
    return _combine({name: _entry(tensor) for name, tensor in base_state_items(model)})
