"""Resumable training checkpoints, written atomically, in safe formats only.

A checkpoint is a directory `checkpoint-000120/` in the run directory holding everything that decides
what the next step computes: the trainable (LoRA) weights, the optimizer and scheduler state, every
process's RNG state, the position in the data stream, and what an objective carries from step to step (GRPO's
completions while a `num_iterations` group trains on them). Resuming from it and training on gives the same
adapter as never stopping (bit for bit on CPU).

Tensors go to safetensors and everything else to JSON: nothing here is ever unpickled. A checkpoint is
written through `finetune.atomic` (a hidden staging directory renamed into place), so a crash mid-write
never leaves something that looks like a whole checkpoint.

Example:
    save_checkpoint(run_dir, step=120, trainable=state, optimizer_state=opt.state_dict(), scheduler=sched, state={...}, keep=2)
    path = latest_checkpoint(run_dir)   # finetune.training.run_files: the run directory's names
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from finetune.atomic import SET_ASIDE_MARK, atomic_directory, remove_directory
from finetune.errors import CheckpointError
from finetune.tensorfile import check_safetensors
from finetune.training.run_files import PREFIX, STATE_FILE, checkpoint_path, list_checkpoints

TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"
CARRIED_FILE = "carried.safetensors"


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, Python), as JSON-ready data."""
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state().tolist(),
        "python": _to_json(random.getstate()),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))
    random.setstate(_from_json(state["python"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["torch_cuda"]])


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple):
        return {"tuple": [_to_json(v) for v in value]}
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_from_json(v) for v in value["tuple"])
    return value


def _split_tensors(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace every tensor inside `value` by a reference, collecting the tensors under dotted names."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().to("cpu", copy=True).contiguous()  # its own storage: safetensors refuses
        # tensors that share one (bitsandbytes' 8-bit Adam holds one qmap in the state of every parameter)
        return {"tensor": prefix}
    if isinstance(value, dict):
        return {"dict": [[k, _split_tensors(v, f"{prefix}.{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"list": [_split_tensors(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]}
    return value


def _join_tensors(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return tensors[value["tensor"]]
    if isinstance(value, dict) and "dict" in value:
        return {k: _join_tensors(v, tensors) for k, v in value["dict"]}
    if isinstance(value, dict) and "list" in value:
        return [_join_tensors(v, tensors) for v in value["list"]]
    return value


def cpu_copy(value: Any) -> Any:
    """`value` (tensors nested in dicts and lists) with every tensor copied to the host: what a process hands
    to the main one (`gather_object` pickles it) to write into a checkpoint."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [cpu_copy(v) for v in value]
    return value


def save_checkpoint(
    run_dir: Path,
    *,
    step: int,
    trainable: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler: Any,
    state: dict[str, Any],
    keep: int,
    carried: list[Any] | None = None,
) -> Path:
    """Write checkpoint `step` atomically and prune all but the newest `keep`.

    Args:
        trainable: the trainable weights (peft's adapter state dict), whole.
        optimizer_state: the optimizer's state dict, whole (gathered from the ranks of a sharded run).
        state: JSON-ready trainer state: step, data position, per-process RNG states, recipe digest.
        carried: per process, what the objective carries into the next steps (tensors nested in dicts and
            lists); None when it carries nothing.
    """
    final = checkpoint_path(run_dir, step)
    with atomic_directory(final, replace=True, error=CheckpointError) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, tmp / TRAINABLE_FILE)
        optimizer_tensors: dict[str, torch.Tensor] = {}
        optimizer_structure = _split_tensors(optimizer_state, "optimizer", optimizer_tensors)
        save_file(optimizer_tensors, tmp / OPTIMIZER_TENSORS_FILE)
        document = {**state, "step": step, "optimizer": optimizer_structure, "scheduler": scheduler.state_dict()}
        if carried is not None:
            carried_tensors: dict[str, torch.Tensor] = {}
            document["carried"] = _split_tensors(carried, "carried", carried_tensors)
            save_file(carried_tensors, tmp / CARRIED_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(document))
    for old in list_checkpoints(run_dir)[:-keep]:
        # out of view first: a SIGKILL in the middle of deleting left a checkpoint without its weights in view
        remove_directory(old)
    for stale in run_dir.glob(f".{PREFIX}*{SET_ASIDE_MARK}*"):  # what such a kill left, hidden
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: Path, *, scheduler: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Restore the scheduler in place; return (trainable weights, optimizer state dict, trainer state)."""
    for name in (TRAINABLE_FILE, OPTIMIZER_TENSORS_FILE):
        check_safetensors(path / name, CheckpointError, "delete this checkpoint to resume from an earlier one")
    try:
        document = json.loads((path / STATE_FILE).read_text())
        trainable = load_file(path / TRAINABLE_FILE)
        optimizer_tensors = load_file(path / OPTIMIZER_TENSORS_FILE)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({exc}); delete it to resume from an earlier one"
        ) from None
    if "carried" in document:
        check_safetensors(path / CARRIED_FILE, CheckpointError, "delete this checkpoint to resume from an earlier one")
        document["carried"] = _join_tensors(document["carried"], load_file(path / CARRIED_FILE))
    optimizer_state = _join_tensors(document.pop("optimizer"), optimizer_tensors)
    optimizer_state["state"] = {int(k): v for k, v in optimizer_state["state"].items()}
    scheduler.load_state_dict(document.pop("scheduler"))
    return trainable, optimizer_state, document
