"""What an on-disk merge, subtract or swap works on: the resolved source model (its ledger, the pristine base
found and checked by fingerprint or absent, quantization, device), the target ledger, and every adapter
either ledger needs.

Nothing is written here; `disk_stream.write_target` carries a `DiskOperation` out. An operation is exact when the
pristine base is at hand (the model itself when nothing is merged into it, else `--base` or the base
its ledger records) and every adapter the target ledger holds can be read back unchanged; otherwise
`pristine_dir` is None and the writer falls back to arithmetic on the merged weights.

Example:
    base = source_base("merged/legal")
    operation = prepare_operation(base, target, {"med": med}, allow_pickle=False)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from finetune.adapters.fit import check_fingerprint
from finetune.adapters.ledger import Ledger
from finetune.adapters.lora import Adapter, read_adapter, recorded_quantization
from finetune.adapters.resolved_base import ResolvedBase, resolve_base, resolve_model_dir
from finetune.errors import AdapterError
from finetune.quantization import Quantization


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter to act on: a directory (or a name the model's ledger holds) and an optional weight."""

    ref: str
    weight: float | None = None


@dataclass
class DiskOperation:
    base: ResolvedBase
    """The source model: its directory and ledger, the pristine base, quantization, output dtype, device."""
    target_ledger: Ledger
    adapters: dict[str, Adapter]
    notes: list[str]
    pristine_dir: Path | None
    """The pristine base's directory; None: no exact path, fall back to arithmetic on the merged weights."""

    @property
    def source_dir(self) -> Path:
        assert self.base.weights_dir is not None, "on-disk arithmetic reads a local model directory"
        return self.base.weights_dir

    @property
    def source_ledger(self) -> Ledger:
        return self.base.ledger

    @property
    def quantization(self) -> Quantization:
        """The base quantization the target's adapters were trained on (its weights are reproduced exactly)."""
        return self.base.quantization if self.pristine_dir is not None else Quantization()


def source_base(
    model: str,
    *,
    pristine: str | None = None,
    force: bool = False,
    dtype: str | None = None,
    device: str | torch.device | None = "auto",
) -> ResolvedBase:
    """The source model resolved for on-disk arithmetic: a local 16/32-bit checkpoint and its ledger."""
    source_dir = resolve_model_dir(model)
    if "quantization_config" in json.loads((source_dir / "config.json").read_text()):
        raise AdapterError(
            f"{source_dir} is a quantized checkpoint; adapter arithmetic on disk needs 16/32-bit weights: use the base "
            "it was quantized from (adapters trained on it are dequantized-merged) or a merge written without --requantize"
        )
    return resolve_base(
        source_dir, pristine=pristine, force=force, dtype=getattr(torch, dtype) if dtype else None, device=device
    )


def read_spec(spec: AdapterSpec, ledger: Ledger, allow_pickle: bool) -> Adapter:
    """An adapter from a directory, or by a name the ledger holds (read from the path it records)."""
    if not Path(spec.ref).exists() and spec.ref in ledger.entries:
        return read_adapter(ledger.entries[spec.ref].path, spec.ref, allow_pickle=allow_pickle)
    if not Path(spec.ref).exists():
        held = f" nor a name the model's ledger holds ({', '.join(sorted(ledger.entries))})" if ledger.entries else ""
        raise AdapterError(f"adapter {spec.ref}: no such directory{held}; give an adapter directory written by peft")
    return read_adapter(spec.ref, allow_pickle=allow_pickle)


def check_new(adapter: Adapter, base: ResolvedBase, force: bool) -> None:
    """An adapter about to be merged was trained on the ledger's base (fingerprint), unless forced."""
    ledger = base.ledger
    check_fingerprint(adapter, ledger.base_fingerprint or None, str(ledger.base_path or base.weights_dir), force=force)


def prepare_operation(
    base: ResolvedBase, target_ledger: Ledger, given: dict[str, Adapter], *, allow_pickle: bool
) -> DiskOperation:
    """Read the adapters both ledgers need and settle the quantization; exact or arithmetic follows from them."""
    operation = DiskOperation(base, target_ledger, dict(given), list(base.notes), base.pristine_dir)
    _read_ledger_adapters(operation, allow_pickle)
    operation.base = replace(base, quantization=_target_quantization(target_ledger, operation.adapters))
    return operation


def _target_quantization(target: Ledger, adapters: dict[str, Adapter]) -> Quantization:
    """The target ledger's base quantization, with the options its adapters recorded (nf4/fp4, double quant)."""
    recorded = recorded_quantization(adapters.values(), strict=False)  # the ledger's base decides
    if recorded is not None and recorded.method == target.base_quantization:
        return recorded
    return Quantization(target.base_quantization)  # type: ignore[arg-type]  # a ledger holds a valid method


def _read_ledger_adapters(operation: DiskOperation, allow_pickle: bool) -> None:
    """Read every adapter either ledger holds that the operation needs; one that cannot be read back
    unchanged rules out the exact path (or fails, when its weight changes and there is no base)."""
    source_weights, target_weights = operation.source_ledger.weights, operation.target_ledger.weights
    changed = {n for n in set(source_weights) | set(target_weights) if source_weights.get(n) != target_weights.get(n)}
    needed_exact = set(target_weights)
    for name in sorted((needed_exact | changed) - set(operation.adapters)):
        entry = operation.source_ledger.entries.get(name) or operation.target_ledger.entries[name]
        try:
            adapter = read_adapter(entry.path, name, allow_pickle=allow_pickle)
        except AdapterError as exc:
            if name in changed or operation.pristine_dir is None:
                raise AdapterError(
                    f"adapter {name!r} recorded in {operation.source_dir}'s ledger cannot be read: {exc}"
                ) from None
            operation.notes.append(f"adapter {name!r} is not readable at {entry.path}, so the base cannot be used")
            operation.pristine_dir = None
            continue
        if not entry.is_merged_form_of(adapter):
            if name in changed and operation.pristine_dir is None:
                raise AdapterError(
                    f"adapter {name!r} at {entry.path} changed since it was merged; give --base to rebuild"
                )
            if name in needed_exact:
                operation.notes.append(
                    f"adapter {name!r} at {entry.path} changed since it was merged, so the base cannot be used"
                )
                operation.pristine_dir = None
        operation.adapters[name] = adapter
