"""Merge, subtract and swap adapters in model checkpoints on disk: the commands behind `finetune adapters`.

Each command turns the source model's ledger into a target ledger, prepares the operation
(`disk_operation`: the pristine base, checked by fingerprint, and the adapters both ledgers need), then writes a new directory shard by
shard (`disk_stream`): exact from the pristine base when it is at hand, so the files equal a fresh merge
bit for bit; else fp32 arithmetic on the merged weights with a drift bound in the result. The output is
built in a staging directory and renamed to `out` at the end.

Example:
    merge_checkpoint("models/tiny", [AdapterSpec("adapters/legal", 1.0)], "merged/legal")
    swap_checkpoint("merged/legal", AdapterSpec("legal"), AdapterSpec("adapters/med"), "merged/med")
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from finetune.adapters.disk_operation import (
    AdapterSpec,
    DiskOperation,
    check_new,
    prepare_operation,
    read_spec,
    source_base,
)
from finetune.adapters.disk_stream import write_target
from finetune.adapters.ledger import Ledger
from finetune.adapters.lora import Adapter, recorded_quantization
from finetune.adapters.model_dir import ensure_free
from finetune.adapters.requantize import requantize_checkpoint
from finetune.adapters.resolved_base import ResolvedBase
from finetune.adapters.result import ArithmeticResult
from finetune.errors import AdapterError

__all__ = ["AdapterSpec", "merge_checkpoint", "subtract_checkpoint", "swap_checkpoint"]


def merge_checkpoint(
    base: str,
    specs: list[AdapterSpec],
    out: str | Path,
    *,
    dtype: str | None = None,
    quantization: str | None = None,
    requantize: bool = False,
    force: bool = False,
    allow_pickle: bool = False,
    device: str | torch.device | None = "auto",
) -> ArithmeticResult:
    """Merge adapters into a base (or into a model already holding merges) and write a full model directory.

    Args:
        base: model directory, `embedded:*` or cached hub id; may itself be a merged model with a ledger.
        specs: adapters and weights (default 1.0).
        out: the directory to create; must not exist.
        dtype: write floating tensors in this dtype (default: as stored).
        quantization: "4bit"/"8bit" if the adapters were trained on a quantized base (default: their manifests).
        requantize: write the merged model quantized like the base instead of 16/32-bit; the report
            gives the relative error this adds (`requantize.requantize_checkpoint`).
        device: where each tensor's update (and a quantized base's round trip) is computed; auto: CUDA
            when present, as training and `load_model` do, so the result equals an in-memory merge there.
    """
    ensure_free(out)
    source = source_base(base, force=force, dtype=dtype, device=device)
    adapters: dict[str, Adapter] = {}
    target = source.ledger
    for spec in specs:
        adapter = read_spec(spec, Ledger(), allow_pickle)
        check_new(adapter, source, force)
        adapters[adapter.name] = adapter
        target = target.plus(adapter.name, 1.0 if spec.weight is None else spec.weight, adapter)
    target = replace(target, base_quantization=_merge_quantization(quantization, adapters, source))
    if requantize and target.base_quantization == "none":
        raise AdapterError("--requantize needs adapters trained on a 4bit or 8bit base (or --quantization 4bit|8bit)")
    operation = prepare_operation(source, target, adapters, allow_pickle=allow_pickle)
    if not requantize:
        return write_target(operation, out, "merge")
    return _merge_requantized(operation, Path(out))


def _merge_quantization(quantization: str | None, adapters: dict[str, Adapter], source: ResolvedBase) -> str:
    """The quantization the adapters were trained on: as given, else what their manifests agree on."""
    ledger = source.ledger
    if quantization is None:
        recorded = recorded_quantization(adapters.values())
        quantization = recorded.method if recorded is not None else ledger.base_quantization
    if ledger.entries and quantization != ledger.base_quantization:
        raise AdapterError(
            f"{source.weights_dir} holds merges on a {ledger.base_quantization} base; cannot add {quantization} ones"
        )
    return quantization


def _merge_requantized(operation: DiskOperation, out: Path) -> ArithmeticResult:
    """A dense exact merge in a scratch directory, then quantized like the base into `out`."""
    dense_dir = out.parent / f".{out.name}.dense-{os.getpid()}"
    shutil.rmtree(dense_dir, ignore_errors=True)
    try:
        report = write_target(operation, dense_dir, "merge")
        errors = requantize_checkpoint(dense_dir, out, operation.quantization, operation.base.device)
    finally:
        shutil.rmtree(dense_dir, ignore_errors=True)
    worst = max(errors, key=lambda module: errors[module])
    report.out = out
    report.notes = [n for n in report.notes if not n.startswith("dequantized the")]
    report.notes.append(
        f"requantized to {operation.quantization.method}: relative Frobenius error added {errors[worst]:.3e} at worst "
        f"({worst}), {sum(errors.values()) / len(errors):.3e} on average over {len(errors)} layers"
    )
    return report


def _merged_source(
    model: str, out: str | Path, *, base: str | None, force: bool, device: str | torch.device | None
) -> ResolvedBase:
    """The merged model a subtract or swap starts from, with `out` checked free first (nothing is read in vain)."""
    ensure_free(out)
    return source_base(model, pristine=base, force=force, device=device)


def subtract_checkpoint(
    model: str,
    spec: AdapterSpec,
    out: str | Path,
    *,
    base: str | None = None,
    negate: bool = False,
    force: bool = False,
    allow_pickle: bool = False,
    device: str | torch.device | None = "auto",
) -> ArithmeticResult:
    """Take an adapter out of a merged model: exact from the base when it is found, else fp32 arithmetic."""
    source = _merged_source(model, out, base=base, force=force, device=device)
    adapter = read_spec(spec, source.ledger, allow_pickle)
    if adapter.name not in source.ledger.entries:
        check_new(adapter, source, force)
    target = source.ledger.minus(adapter.name, spec.weight, adapter, negate=negate, where=str(source.weights_dir))
    operation = prepare_operation(source, target, {adapter.name: adapter}, allow_pickle=allow_pickle)
    if adapter.name not in source.ledger.entries:
        operation.notes.append(f"task negation: {adapter.name!r} was never merged into {source.weights_dir}")
    return write_target(operation, out, "subtract")


def swap_checkpoint(
    model: str,
    remove: AdapterSpec,
    add: AdapterSpec,
    out: str | Path,
    *,
    base: str | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    device: str | torch.device | None = "auto",
) -> ArithmeticResult:
    """Replace merged adapter `remove` by `add`: with the base at hand, equal to a fresh merge of `add`."""
    source = _merged_source(model, out, base=base, force=force, device=device)
    old = read_spec(remove, source.ledger, allow_pickle)
    new = read_spec(add, Ledger(), allow_pickle)
    check_new(new, source, force)
    if old.name not in source.ledger.entries:
        held = ", ".join(sorted(source.ledger.entries)) or "nothing"
        raise AdapterError(f"cannot swap out {old.name!r}: {source.weights_dir} holds {held}")
    target = source.ledger.minus(old.name, None, old, negate=False)
    target = target.plus(new.name, 1.0 if add.weight is None else add.weight, new)
    return write_target(
        prepare_operation(source, target, {old.name: old, new.name: new}, allow_pickle=allow_pickle), out, "swap"
    )
