"""What to change when a run does not fit a device, each change with its own estimated peak.

The changes users reach for, in order of how little they change the run: gradient checkpointing (same
result, slower), a smaller micro-batch with more accumulation (same batch, slower), a 4-bit base (QLoRA:
a different base precision), FSDP over more devices (more hardware). Each is a recipe override validated
like any other, so a suggestion is never a recipe `finetune train` would refuse.

Example:
    for change in suggestions(recipe, shape, device="cuda", nproc=1, device_bytes=24 * GiB):
        print(change.description, change.plan.peak_bytes, change.fits)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from finetune.errors import FinetuneError
from finetune.plan.memory import MemoryPlan, estimate
from finetune.plan.shape import ModelShape
from finetune.recipe import Recipe, load_recipe


@dataclass(frozen=True)
class Suggestion:
    description: str
    overrides: tuple[str, ...]
    nproc: int
    plan: MemoryPlan
    fits: bool


def _try(
    recipe: Recipe, shape: ModelShape, overrides: list[str], nproc: int, device: Literal["cpu", "cuda"], budget: int
) -> tuple[MemoryPlan, bool] | None:
    """The plan of `recipe` with `overrides` on `nproc` processes, or None when the recipe refuses the change."""
    try:
        changed = load_recipe(recipe, overrides)
    except FinetuneError:  # e.g. FSDP on a quantized base: not a change to suggest
        return None
    plan = estimate(changed, shape, device=device, nproc=nproc, device_bytes=budget)
    return plan, plan.peak_bytes <= budget


def _candidates(recipe: Recipe, nproc: int) -> list[tuple[str, list[str], int]]:
    """(description, overrides, processes) of every single change worth estimating for `recipe`."""
    train, found = recipe.train, []
    if train.gradient_checkpointing is not True and train.gradient_checkpointing != "auto":  # auto: already tried
        found.append(("gradient checkpointing", ["train.gradient_checkpointing=true"], nproc))
    micro = train.micro_batch_size // 2
    while micro >= 1:
        accum = train.grad_accum_steps * train.micro_batch_size // micro
        found.append((f"micro-batch {micro} x {accum} accumulation (same batch)",
                      [f"train.micro_batch_size={micro}", f"train.grad_accum_steps={accum}"], nproc))  # fmt: skip
        micro //= 2
    if recipe.model.quantization == "none":
        found.append(("QLoRA: 4-bit nf4 base", ["model.quantization=4bit"], nproc))
        for devices in (2, 4, 8):
            if devices > nproc:
                found.append((f"FSDP over {devices} devices", ["distributed.strategy=fsdp"], devices))
    return found


def suggestions(
    recipe: Recipe, shape: ModelShape, *, device: Literal["cpu", "cuda"], nproc: int, device_bytes: int
) -> list[Suggestion]:
    """Single changes, each estimated; of the micro-batch and FSDP ladders only the first that fits (or the last)."""
    result: list[Suggestion] = []
    for description, overrides, processes in _candidates(recipe, nproc):
        tried = _try(recipe, shape, overrides, processes, device, device_bytes)
        if tried is None:
            continue
        family = description.split(" ")[0]
        if result and result[-1].description.split(" ")[0] == family and not result[-1].fits:
            result.pop()  # a rung of a ladder that did not fit: the next rung replaces it
        elif result and result[-1].description.split(" ")[0] == family:
            continue  # the ladder already has a rung that fits
        result.append(Suggestion(description, tuple(overrides), processes, tried[0], tried[1]))
    if result and not any(s.fits for s in result):
        combined = [o for s in result if not s.description.startswith("FSDP") for o in s.overrides]
        tried = _try(recipe, shape, combined, nproc, device, device_bytes)
        if tried is not None:
            result.append(Suggestion("all of the above but FSDP", tuple(combined), nproc, tried[0], tried[1]))
    return result
