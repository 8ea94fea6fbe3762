"""Planning an on-disk merge, subtract or swap: the source model and its ledger, the target ledger, the
pristine base (found and checked by fingerprint, or absent), and every adapter either ledger needs.

Nothing is written here; `disk_stream.write_target` carries a `DiskPlan` out. A plan is exact when the
pristine base is at hand (the model itself when nothing is merged into it, else `--base` or the base
its ledger records) and every adapter the target ledger holds can be read back unchanged; otherwise
`pristine_dir` is None and the writer falls back to arithmetic on the merged weights.

Example:
    source_dir, ledger = source("merged/legal")
    plan = make_plan(source_dir, ledger, target, {"med": med}, base=None, force=False, allow_pickle=False)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from finetune.adapters.ledger import Ledger, read_ledger
from finetune.adapters.lora import Adapter, read_adapter
from finetune.errors import AdapterError
from finetune.fingerprint import fingerprint_model_dir, weight_files


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter to act on: a directory (or a name the model's ledger holds) and an optional weight."""

    ref: str
    weight: float | None = None


@dataclass
class DiskPlan:
    source_dir: Path
    source_ledger: Ledger
    target_ledger: Ledger
    pristine_dir: Path | None
    """The pristine base's directory; None: no exact path, fall back to arithmetic on the merged weights."""
    adapters: dict[str, Adapter]
    notes: list[str]


def resolve_model_dir(ref: str) -> Path:
    """A local model directory for `ref` (a path, `embedded:*`, or a hub id in the local cache)."""
    from finetune.embedded import resolve_base_id
    from finetune.paths import local_model_dir

    directory = local_model_dir(resolve_base_id(ref))
    if directory is None or not (directory / "config.json").is_file():
        raise AdapterError(f"{ref} is not a model directory (no config.json) nor a cached hub model; give a local path")
    if not weight_files(directory):
        raise AdapterError(f"{directory} holds no *.safetensors weights; re-save it with save_pretrained (safetensors)")
    return directory


def source(model: str) -> tuple[Path, Ledger]:
    """The model directory and its ledger (an empty one on top of itself when nothing is merged into it)."""
    source_dir = resolve_model_dir(model)
    if "quantization_config" in json.loads((source_dir / "config.json").read_text()):
        raise AdapterError(
            f"{source_dir} is a quantized checkpoint; adapter arithmetic on disk needs 16/32-bit weights: use the base "
            "it was quantized from (adapters trained on it are dequantized-merged) or a merge written without --requantize"
        )
    ledger = read_ledger(source_dir)
    if ledger is None:
        ledger = Ledger(base_path=str(source_dir.resolve()), base_fingerprint=fingerprint_model_dir(source_dir))
    return source_dir, ledger


def read_spec(spec: AdapterSpec, ledger: Ledger, allow_pickle: bool) -> Adapter:
    """An adapter from a directory, or by a name the ledger holds (read from the path it records)."""
    if not Path(spec.ref).exists() and spec.ref in ledger.entries:
        return read_adapter(ledger.entries[spec.ref].path, spec.ref, allow_pickle=allow_pickle)
    if not Path(spec.ref).exists():
        held = f" nor a name the model's ledger holds ({', '.join(sorted(ledger.entries))})" if ledger.entries else ""
        raise AdapterError(f"adapter {spec.ref}: no such directory{held}; give an adapter directory written by peft")
    return read_adapter(spec.ref, allow_pickle=allow_pickle)


def check_new(adapter: Adapter, ledger: Ledger, where: Path, force: bool) -> None:
    """An adapter about to be merged was trained on the ledger's base (fingerprint), unless forced."""
    from finetune.fingerprint import check_fingerprint

    check_fingerprint(adapter, ledger.base_fingerprint or None, str(ledger.base_path or where), force=force)


def make_plan(
    source_dir: Path,
    source_ledger: Ledger,
    target_ledger: Ledger,
    given: dict[str, Adapter],
    *,
    base: str | None,
    force: bool,
    allow_pickle: bool,
) -> DiskPlan:
    """Find the pristine base and the adapters both ledgers need; exact or arithmetic follows from them."""
    pristine_dir, notes = _find_pristine_base(source_dir, source_ledger, base, force)
    plan = DiskPlan(source_dir, source_ledger, target_ledger, pristine_dir, dict(given), notes)
    _read_ledger_adapters(plan, allow_pickle)
    return plan


def _find_pristine_base(
    source_dir: Path, ledger: Ledger, base: str | None, force: bool
) -> tuple[Path | None, list[str]]:
    """The base to recompute from (checked against the ledger's fingerprint), or None, and notes on why."""
    if not ledger.entries and base is None:
        return source_dir, []  # nothing merged: the model is its own pristine base
    notes: list[str] = []
    candidate = base or ledger.base_path
    try:
        pristine_dir = resolve_model_dir(candidate) if candidate else None
    except AdapterError:
        if base is not None:
            raise
        return None, [f"the recorded base {candidate} is not available"]
    if pristine_dir is not None and ledger.base_fingerprint:
        found = fingerprint_model_dir(pristine_dir)
        if found != ledger.base_fingerprint:
            message = (
                f"{pristine_dir} ({found}) is not the base {source_dir} was merged from "
                f"({ledger.base_path}, {ledger.base_fingerprint}); pass the right --base or --force"
            )
            if not force:
                raise AdapterError(message)
            notes.append("forced: " + message)
    return pristine_dir, notes


def _read_ledger_adapters(plan: DiskPlan, allow_pickle: bool) -> None:
    """Read every adapter either ledger holds that the operation needs; one that cannot be read back
    unchanged rules out the exact path (or fails, when its weight changes and there is no base)."""
    source_weights, target_weights = plan.source_ledger.weights, plan.target_ledger.weights
    changed = {n for n in set(source_weights) | set(target_weights) if source_weights.get(n) != target_weights.get(n)}
    needed_exact = set(target_weights)
    for name in sorted((needed_exact | changed) - set(plan.adapters)):
        entry = plan.source_ledger.entries.get(name) or plan.target_ledger.entries[name]
        try:
            adapter = read_adapter(entry.path, name, allow_pickle=allow_pickle)
        except AdapterError as exc:
            if name in changed or plan.pristine_dir is None:
                raise AdapterError(
                    f"adapter {name!r} recorded in {plan.source_dir}'s ledger cannot be read: {exc}"
                ) from None
            plan.notes.append(f"adapter {name!r} is not readable at {entry.path}, so the base cannot be used")
            plan.pristine_dir = None
            continue
        if entry.sha256 and adapter.file_sha256 != entry.sha256:
            if name in changed and plan.pristine_dir is None:
                raise AdapterError(
                    f"adapter {name!r} at {entry.path} changed since it was merged; give --base to rebuild"
                )
            if name in needed_exact:
                plan.notes.append(
                    f"adapter {name!r} at {entry.path} changed since it was merged, so the base cannot be used"
                )
                plan.pristine_dir = None
        plan.adapters[name] = adapter
