"""`finetune plan RECIPE [key=value ...] [--json] [--nproc N] [--device-memory 24GB]`: will it fit?

Estimates the peak memory of the recipe's run per device (per rank with `--nproc`) from the base's
config.json alone, before anything is loaded; see `finetune.plan`.

Example:
    finetune plan llama-3.1-8b-instruct-chat --device-memory 24GB
    finetune plan my.yaml distributed.strategy=fsdp --nproc 4 --json
"""

from __future__ import annotations

import argparse
import json
import re
from typing import TYPE_CHECKING, Literal

from finetune.errors import FinetuneError

if TYPE_CHECKING:
    from finetune.plan.memory import MemoryPlan
    from finetune.plan.shape import ModelShape
    from finetune.recipe import Recipe

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|k|m|g|t)?(i?b)?\s*$", re.IGNORECASE)


def parse_memory_size(text: str) -> int:
    """`24GB`, `24GiB`, `24G`, `16000MB` or plain bytes. GB is read as GiB, as GPU memory is quoted (a 24 GB
    card holds 24 GiB)."""
    match = _SIZE.match(text)
    if not match:
        raise FinetuneError(f"--device-memory {text!r}: not a size; write e.g. 24GB, 80GiB or 16000MB")
    unit = (match.group(2) or "b").lower()
    size = int(float(match.group(1)) * 1024 ** "bkmgt".index(unit))
    if size < 2**20:  # `16` is 16 bytes: surely a size without its unit
        raise FinetuneError(f"--device-memory {text!r} is under 1 MiB; write the unit, e.g. 16GB or 80GiB")
    return size


def register(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser("plan", help="estimate a recipe's peak memory per device before loading anything")
    plan.add_argument("recipe", help="YAML recipe or catalog name, e.g. llama-3.1-8b-instruct-chat")
    plan.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="recipe overrides, e.g. train.micro_batch_size=1"
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help="print the plan as JSON: peak_bytes (per rank), host_bytes, parts, notes, ...",
    )
    plan.add_argument("--nproc", type=int, default=1, help="processes (GPUs) the run is spread over; per-rank figures")
    plan.add_argument(
        "--device-memory",
        help="memory of one device, e.g. 24GB (GB read as GiB; a bare number is bytes): says whether it fits, and if "
        "not what to change",
    )
    plan.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                      help="what the run trains on (auto: a GPU when torch sees one)")  # fmt: skip
    plan.add_argument("--config", help="the base's config.json (or its directory) when it is not on this machine")
    plan.set_defaults(handler=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from finetune.cpu_features import bf16_cpu_note
    from finetune.plan.memory import estimate
    from finetune.plan.model_config import find_model_config
    from finetune.plan.shape import model_shape
    from finetune.recipe import load_recipe

    if args.nproc < 1:
        raise FinetuneError(f"--nproc {args.nproc}: must be at least 1")
    device_bytes = parse_memory_size(args.device_memory) if args.device_memory else None
    recipe = load_recipe(args.recipe, args.overrides)
    config, source = find_model_config(recipe.model.base, recipe.model.revision, args.config)
    shape = model_shape(config, recipe.lora)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = recipe.for_device(device)
    plan = estimate(recipe, shape, device=device, nproc=args.nproc, device_bytes=device_bytes)
    cpu_notes = (
        bf16_cpu_note(recipe.model.dtype, recipe.train.precision, device=device),
        cpu_heap_note(recipe, device),
    )
    notes = [note for note in cpu_notes if note]
    if device_bytes is not None:
        notes += fewer_checkpointed_layers_note(recipe, shape, plan, device, args.nproc, device_bytes)
    found = []
    if device_bytes is not None and plan.peak_bytes > device_bytes:
        from finetune.plan.suggest import suggestions

        found = suggestions(recipe, shape, device=device, nproc=args.nproc, device_bytes=device_bytes)
    if args.json:
        result = {**plan.as_json(), "notes": notes}
        if device_bytes is not None:
            result["device_memory_bytes"] = device_bytes
            result["fits"] = plan.peak_bytes <= device_bytes
            result["suggestions"] = [
                {"change": s.description, "overrides": list(s.overrides), "nproc": s.nproc,
                 "peak_bytes": s.plan.peak_bytes, "fits": s.fits} for s in found
            ]  # fmt: skip
        print(json.dumps(result, indent=2))
        return 0
    from finetune.commands.plan_view import render

    print(render(args.recipe, recipe, source, plan, device_bytes, found, notes=notes))
    return 0


CPU_HEAP_TOKENS = 1024
"""Tokens per micro-batch from which a CPU run's resident memory was measured above the plan."""


def cpu_heap_note(recipe: Recipe, device: str) -> str | None:
    """On the CPU, one line saying that resident memory can exceed the plan at larger micro-batches.

    The plan counts tensors; glibc's allocator keeps what they free in its heap for reuse instead of returning
    it to the system, and that grows with the tokens of a micro-batch. `bench/plan_accuracy.py` (a 56M-parameter
    Llama, float32, AMD EPYC, two runs 2026-11-28): peak RSS 1.08-1.13x the plan at 1,024 tokens per micro-batch,
    1.21-1.33x at 2,048, 1.55-1.59x at 4,096 (the heap's reuse varies); with `MALLOC_MMAP_THRESHOLD_=65536`
    0.77-0.92x, the run up to 46% slower.
    """
    tokens = recipe.train.micro_batch_size * recipe.data.max_seq_len
    if device != "cpu" or tokens < CPU_HEAP_TOKENS:
        return None
    return (
        f"on the CPU, resident memory can exceed this plan at {tokens:,} tokens per micro-batch: it counts tensors, "
        "and glibc's allocator keeps the memory they free for reuse (bench/plan_accuracy.py: 1.1x the plan at 1,024 "
        "tokens, 1.2-1.3x at 2,048, 1.6x at 4,096); MALLOC_MMAP_THRESHOLD_=65536 returns it, at up to 46% more time"
    )


def fewer_checkpointed_layers_note(
    recipe: Recipe, shape: ModelShape, plan: MemoryPlan, device: Literal["cpu", "cuda"], nproc: int, device_bytes: int
) -> list[str]:
    """One line where `gradient_checkpointing: auto` would recompute fewer layers than the recipe asks on this device."""
    from finetune.plan.memory import GiB, estimate
    from finetune.recipe import load_recipe

    if recipe.train.gradient_checkpointing == "auto" or plan.checkpointed_layers == 0:
        return []
    auto = estimate(load_recipe(recipe, ["train.gradient_checkpointing=auto"]), shape, device=device, nproc=nproc,
                    device_bytes=device_bytes)  # fmt: skip
    if auto.checkpointed_layers >= plan.checkpointed_layers:
        return []
    return [
        f"faster here: train.gradient_checkpointing=auto checkpoints {auto.checkpointed_layers} of {plan.num_layers} "
        f"layers on this device (peak {auto.peak_bytes / GiB:.2f} GiB), recomputing less"
    ]
