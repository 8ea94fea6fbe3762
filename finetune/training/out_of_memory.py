"""A run that runs out of memory ends with one line naming the settings that set its peak, not a traceback.

torch reports it three ways: `torch.OutOfMemoryError` on a GPU, a `RuntimeError` from its CPU allocator
("DefaultCPUAllocator: can't allocate memory") on the host, and Python's `MemoryError` where an allocation of
Python's own fails first. What sets the peak is the recipe: the tokens of a micro-batch, how many decoder
layers are checkpointed, the dtype of the base. `finetune plan` estimates it before a run.

The caller raises the line after its `except` block has ended: until then the exception's traceback holds
the frames of the failed step, and so its tensors (raised inside the handler, or from a context manager's
`__exit__`, the new error would keep the old one as its `__context__`). A caller of the Python API that catches
the error then gets the memory back.

Example:
    line = None
    try:
        return run_the_training()
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        line = out_of_memory_line(recipe, error)
    raise TrainingError(line)
"""

from __future__ import annotations

import re

import torch

from finetune.recipe import Recipe

CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
_REQUESTED = re.compile(r"(?:tried to )?allocate (\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed, on the GPU, in torch's CPU allocator or in Python."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(error)


def out_of_memory_line(recipe: Recipe, error: BaseException) -> str:
    """The one line: which memory ran out (a GPU's raises `torch.OutOfMemoryError`), how much was asked for (where
    torch says), and what lowers the peak."""
    requested = _REQUESTED.search(str(error))
    asked = ""
    if requested:
        unit_bytes = {"bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}[requested.group(2).lower()]
        asked = f" while allocating {float(requested.group(1)) * unit_bytes / 2**20:,.0f} MiB"
    train = recipe.train
    setting = train.gradient_checkpointing
    checkpointing = str(setting).lower() if isinstance(setting, bool) else str(setting)  # as a recipe writes it
    return (
        f"out of {'GPU' if isinstance(error, torch.OutOfMemoryError) else 'host'} memory{asked} with train.micro_batch_size="
        f"{train.micro_batch_size} x data.max_seq_len={recipe.data.max_seq_len} tokens and "
        f"train.gradient_checkpointing={checkpointing}; lower train.micro_batch_size (raising "
        "train.grad_accum_steps keeps the batch), checkpoint more layers (train.gradient_checkpointing=true) or "
        "shorten data.max_seq_len; `finetune plan` estimates the peak"
    )
