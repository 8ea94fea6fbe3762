"""Which device a model runs on, and putting inputs where the model is.

Users train and serve on GPUs; this machine's tests run on CPU. Every entry point that loads a model
(`load_model`, `eval`, `generate`, `serve`) takes a device, `auto` by default: the first CUDA device
when there is one, else the CPU. Inputs are built where the model's weights are (`model_device`), never
assumed to be on the CPU.

Example:
    device = resolve_device("auto")                  # cuda:0 on a GPU machine, cpu elsewhere
    batch = to_device(collate(rows), model_device(model))
"""

from __future__ import annotations

import torch

from finetune.errors import FinetuneError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""What the command line offers; the Python API also takes `cuda:N` and `torch.device` values."""


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """`auto`/None -> CUDA when present, else CPU; `cuda`, `cuda:N` or `cpu` as asked.

    Raises:
        FinetuneError: a CUDA device was asked for and there is none (one line saying what to do).
    """
    if device is None or str(device) == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise FinetuneError(f"device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = resolved.index if resolved.index is not None else 0
        if index >= count:
            visible = f"{count} CUDA device(s) are visible" if count else "no CUDA device is visible"
            raise FinetuneError(f"device {device} was asked for but {visible}; use --device cpu (or auto)")
        return torch.device("cuda", index)
    if resolved.type != "cpu":
        raise FinetuneError(f"device {device!r} is not supported; use auto, cpu, cuda or cuda:N")
    return resolved


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's input embeddings (where input ids must go), else of its first parameter."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return next(model.parameters()).device


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a collated batch on `device` (copies from pinned memory do not block the host); other
    values (the records an online objective keeps beside its tensors) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
