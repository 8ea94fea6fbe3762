"""Merge, subtract and swap adapters in model checkpoints on disk, streaming one safetensors shard at a time.

Each command turns the source model's ledger into a target ledger and writes a new directory:

- **exact** (the pristine base is at hand: the model itself when nothing is merged into it, else
  `--base` or the base path the ledger records, checked by fingerprint): every tensor is read from the
  base and each touched one becomes round(W_base + Σ wᵢ·ΔWᵢ) over the *target* ledger, the same formula
  as in memory (`arithmetic.merged_weight`), so the files equal a fresh merge bit for bit;
- **arithmetic** (no base found, or an adapter the ledger holds cannot be read back unchanged): each
  touched tensor becomes round(W_model + Σ (w_new − w_old)·ΔW) in fp32, and the report gives the largest
  drift this can cause against an exact merge (half an ulp of the stored value plus half an ulp of the
  result, per element).

Peak memory is one shard of tensors plus the adapters (fp32) plus one fp32 accumulator. The output is
built in a staging directory and renamed to `--out` at the end (`model_dir.staging_dir`). Adapters trained
on a 4-bit/8-bit base are merged into the weights they were trained against: every linear weight
bitsandbytes would quantize goes through the same quantize → dequantize round trip, and the model is
written in 16/32-bit.

Example:
    merge_checkpoint("models/tiny", [AdapterSpec("adapters/legal", 1.0)], "merged/legal")
    swap_checkpoint("merged/legal", AdapterSpec("legal"), AdapterSpec("adapters/med"), "merged/med")
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from finetune.adapters.arithmetic import half_ulp, merged_weight, module_terms
from finetune.adapters.ledger import Ledger, read_ledger
from finetune.adapters.lora import Adapter, read_adapter
from finetune.adapters.model_dir import (
    INDEX_NAME,
    after_shard_hook,
    copy_side_files,
    ensure_free,
    staging_dir,
    write_config,
    write_index,
    write_shard,
)
from finetune.adapters.tied import TIE_KEY, stored_aliases
from finetune.errors import AdapterError
from finetune.fingerprint import fingerprint_model_dir, weight_files

_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter named on the command line: a directory (or a name the ledger holds) and an optional weight."""

    ref: str
    weight: float | None = None


def parse_adapter_spec(spec: str) -> AdapterSpec:
    """`adapters/legal:0.5` -> AdapterSpec('adapters/legal', 0.5); a suffix that is not a number is part of the path."""
    ref, separator, tail = spec.rpartition(":")
    if separator and ref:
        try:
            weight = float(tail)
        except ValueError:
            return AdapterSpec(spec)
        if not math.isfinite(weight):
            raise AdapterError(f"adapter {spec!r}: weight {tail!r} is not a finite number; write e.g. {ref}:0.5")
        return AdapterSpec(ref, weight)
    return AdapterSpec(spec)


@dataclass
class DiskReport:
    """What an on-disk command wrote: for the CLI's output and for benchmarks."""

    operation: str
    out: Path
    merged: dict[str, float]
    exact: bool
    tensors_with_updates: int
    shards: int
    seconds: float
    max_drift_bound: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        merged = ", ".join(f"{n}:{w:g}" for n, w in self.merged.items()) or "nothing"
        how = (
            "exact, from the pristine base"
            if self.exact
            else (
                f"fp32 arithmetic on the merged weights (no pristine base): largest possible drift vs an exact merge "
                f"{self.max_drift_bound:.3e}"
            )
        )
        lines = [
            f"{self.operation}: wrote {self.out} ({self.shards} shard(s), {self.tensors_with_updates} tensors with updates, "
            f"{self.seconds:.2f} s); merged now: {merged}; {how}"
        ]
        return "\n".join(lines + self.notes)


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


def tensor_headers(model_dir: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, safetensors dtype, shape), from the headers alone."""
    from safetensors import safe_open

    headers = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                headers[name] = (path, tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
    return headers


def _check_targets(adapter: Adapter, headers: dict, where: Path, aliases: dict[str, str]) -> None:
    """Every module the adapter targets exists in the checkpoint with the right shape; else name the first."""
    for module, lora in sorted(adapter.modules.items()):
        key = aliases.get(module + ".weight", module + ".weight")
        if key not in headers:
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.path}) targets {module}, but {where} has no tensor {key} (another "
                "architecture, or a weight tied to another one)"
            )
        if tuple(headers[key][2]) != tuple(lora.weight_shape):
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.path}): {key} is {headers[key][2]} in {where} but the update is "
                f"{lora.weight_shape}: the adapter was trained on another base size"
            )


def _check_base_copies(adapter: Adapter, headers: dict, aliases: dict[str, str]) -> None:
    """The base weights peft saved beside embedding LoRA (`Adapter.base_copies`) equal the pristine base's."""
    from safetensors import safe_open

    for module in sorted(adapter.base_copies):
        key = aliases.get(module + ".weight", module + ".weight")
        with safe_open(str(headers[key][0]), framework="pt") as handle:
            stored = handle.get_tensor(key)
        adapter.check_base_copy(module, stored)


def _quantizable_weights(model_dir: Path) -> set[str]:
    """Names of the weights bitsandbytes quantizes on load: every nn.Linear except the output embeddings."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    output = model.get_output_embeddings()
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not output}


def _quantization_roundtrip(weight: torch.Tensor, quantization: str, options: dict) -> torch.Tensor:
    from finetune.adapters.quantized import dequantize, quantized_linear

    bits = 4 if quantization == "4bit" else 8
    layer = quantized_linear(
        weight,
        bits,
        quant_type=options.get("bnb_4bit_quant_type", "nf4"),
        double_quant=options.get("bnb_4bit_use_double_quant", True),
    )
    return dequantize(layer)


@dataclass
class _Plan:
    source_dir: Path
    source_ledger: Ledger
    target_ledger: Ledger
    pristine_dir: Path | None
    adapters: dict[str, Adapter]
    notes: list[str]


def _read_spec(spec: AdapterSpec, ledger: Ledger, allow_pickle: bool) -> Adapter:
    """An adapter from a directory, or by a name the ledger holds (read from the path it records)."""
    if not Path(spec.ref).exists() and spec.ref in ledger.entries:
        return read_adapter(ledger.entries[spec.ref].path, spec.ref, allow_pickle=allow_pickle)
    if not Path(spec.ref).exists():
        held = f" nor a name the model's ledger holds ({', '.join(sorted(ledger.entries))})" if ledger.entries else ""
        raise AdapterError(f"adapter {spec.ref}: no such directory{held}; give an adapter directory written by peft")
    return read_adapter(spec.ref, allow_pickle=allow_pickle)


def _source(model: str) -> tuple[Path, Ledger]:
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


def _plan(
    source_dir: Path,
    source_ledger: Ledger,
    target_ledger: Ledger,
    given: dict[str, Adapter],
    *,
    base: str | None,
    force: bool,
    allow_pickle: bool,
) -> _Plan:
    """Find the pristine base and the adapters both ledgers need; choose exact or arithmetic."""
    notes: list[str] = []
    pristine_dir: Path | None = None
    if not source_ledger.entries and base is None:
        pristine_dir = source_dir  # nothing merged: the model is its own pristine base
    else:
        candidate = base or source_ledger.base_path
        try:
            pristine_dir = resolve_model_dir(candidate) if candidate else None
        except AdapterError:
            if base is not None:
                raise
            notes.append(f"the recorded base {candidate} is not available")
        if pristine_dir is not None and source_ledger.base_fingerprint:
            found = fingerprint_model_dir(pristine_dir)
            if found != source_ledger.base_fingerprint:
                message = (
                    f"{pristine_dir} ({found}) is not the base {source_dir} was merged from "
                    f"({source_ledger.base_path}, {source_ledger.base_fingerprint}); pass the right --base or --force"
                )
                if not force:
                    raise AdapterError(message)
                notes.append("forced: " + message)

    adapters = dict(given)
    changed = {
        name
        for name in set(source_ledger.weights) | set(target_ledger.weights)
        if source_ledger.weights.get(name) != target_ledger.weights.get(name)
    }
    needed_exact = set(target_ledger.weights)
    for name in sorted((needed_exact | changed) - set(adapters)):
        entry = source_ledger.entries.get(name) or target_ledger.entries[name]
        try:
            adapter = read_adapter(entry.path, name, allow_pickle=allow_pickle)
        except AdapterError as exc:
            if name in changed or pristine_dir is None:
                raise AdapterError(
                    f"adapter {name!r} recorded in {source_dir}'s ledger cannot be read: {exc}"
                ) from None
            notes.append(f"adapter {name!r} is not readable at {entry.path}, so the base cannot be used")
            pristine_dir = None
            continue
        if entry.sha256 and adapter.file_sha256 != entry.sha256:
            if name in changed and pristine_dir is None:
                raise AdapterError(
                    f"adapter {name!r} at {entry.path} changed since it was merged; give --base to rebuild"
                )
            if name in needed_exact:
                notes.append(
                    f"adapter {name!r} at {entry.path} changed since it was merged, so the base cannot be used"
                )
                pristine_dir = None
        adapters[name] = adapter
    return _Plan(source_dir, source_ledger, target_ledger, pristine_dir, adapters, notes)


def _execute(plan: _Plan, out: str | Path, operation: str, *, dtype: str | None) -> DiskReport:
    """Write the target ledger's model into `out`, shard by shard (see the module docstring)."""
    from safetensors import safe_open

    started = time.perf_counter()
    out = ensure_free(out)
    exact = plan.pristine_dir is not None
    read_dir = plan.pristine_dir if plan.pristine_dir is not None else plan.source_dir
    target, source = plan.target_ledger.weights, plan.source_ledger.weights
    if exact:
        weights = target
    else:
        weights = {n: target.get(n, 0.0) - source.get(n, 0.0) for n in set(target) | set(source)}
        weights = {n: w for n, w in weights.items() if w != 0.0}
    terms = module_terms(weights, plan.adapters)
    source_headers = tensor_headers(plan.source_dir)
    read_headers = source_headers if read_dir == plan.source_dir else tensor_headers(read_dir)
    aliases = stored_aliases(read_dir, read_headers)
    for adapter in plan.adapters.values():
        _check_targets(adapter, read_headers, read_dir, aliases)
        if exact:
            _check_base_copies(adapter, read_headers, aliases)
    untied = _names_to_untie(aliases, terms)
    quantization = plan.target_ledger.base_quantization
    roundtrip = _quantizable_weights(read_dir) if exact and quantization != "none" else set()
    options = _quantization_options(plan.adapters)
    out_dtype_override = getattr(torch, dtype) if dtype else None

    max_drift_bound, rewritten = 0.0, 0
    files = sorted({header[0] for header in read_headers.values()})
    with staging_dir(out) as tmp:
        weight_map: dict[str, str] = {}
        total_bytes = 0
        for path in files:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    stored = _SAFETENSORS_DTYPES.get(source_headers.get(name, (None, "", ()))[1], tensor.dtype)
                    out_dtype = (out_dtype_override or stored) if tensor.is_floating_point() else tensor.dtype
                    module = name.removesuffix(".weight")
                    base = tensor.to(out_dtype)
                    if name in roundtrip:
                        base = _quantization_roundtrip(base, quantization, options)
                    if module in terms and name.endswith(".weight"):
                        result = merged_weight(base, terms[module], out_dtype, module=module)
                        if not exact:
                            bound = (half_ulp(tensor) + half_ulp(result)).max().item()
                            max_drift_bound = max(max_drift_bound, bound)
                        rewritten += 1
                    else:
                        result = base.to(out_dtype)
                    tensors[name] = result
                    for tied_name in untied.get(name, []):  # the tied partner gets a tensor of its own
                        tied_module = tied_name.removesuffix(".weight")
                        tensors[tied_name] = merged_weight(
                            base, terms.get(tied_module, []), out_dtype, module=tied_module
                        )
                        rewritten += tied_module in terms
            total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update(write_shard(tmp, path.name, tensors, plan.target_ledger))
            del tensors
            after_shard_hook()
        if len(files) > 1 or (read_dir / INDEX_NAME).is_file():
            write_index(tmp, weight_map, total_bytes)
        copy_side_files(plan.source_dir, tmp)
        config = json.loads((plan.source_dir / "config.json").read_text())
        if aliases:  # the base ties weights: the output does too, unless an update touches one of them
            config[TIE_KEY] = not untied
        write_config(tmp, config, plan.target_ledger, out_dtype_override or _single_dtype(source_headers))
    notes = list(plan.notes)
    if quantization != "none" and exact:
        notes.append(
            f"dequantized the {quantization} base ({len(roundtrip)} linear weights) and wrote 16/32-bit weights"
        )
    return DiskReport(
        operation, out, target, exact, rewritten, len(files), time.perf_counter() - started, max_drift_bound, notes
    )


def _names_to_untie(aliases: dict[str, str], terms: dict) -> dict[str, list[str]]:
    """stored name -> tied names to write beside it: those whose pair (either side) holds an update."""
    untie: dict[str, list[str]] = {}
    for tied_name, stored in sorted(aliases.items()):
        if {tied_name.removesuffix(".weight"), stored.removesuffix(".weight")} & set(terms):
            untie.setdefault(stored, []).append(tied_name)
    return untie


def _single_dtype(headers: dict) -> torch.dtype | None:
    dtypes = {_SAFETENSORS_DTYPES[h[1]] for h in headers.values() if h[1] in _SAFETENSORS_DTYPES}
    return dtypes.pop() if len(dtypes) == 1 else None


def _quantization_options(adapters: dict[str, Adapter]) -> dict:
    """bitsandbytes 4-bit options from the adapters' recorded recipes (defaults: nf4, double quantization)."""
    for adapter in adapters.values():
        recipe = adapter.manifest.recipe if adapter.manifest is not None else None
        if recipe and isinstance(recipe.get("model"), dict):
            return {k: v for k, v in recipe["model"].items() if k.startswith("bnb_4bit_")}
    return {}


def _check_new(adapter: Adapter, ledger: Ledger, where: Path, force: bool) -> None:
    from finetune.fingerprint import check_fingerprint

    check_fingerprint(adapter, ledger.base_fingerprint or None, str(ledger.base_path or where), force=force)


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
) -> DiskReport:
    """Merge adapters into a base (or into a model already holding merges) and write a full model directory.

    Args:
        base: model directory, `embedded:*` or cached hub id; may itself be a merged model with a ledger.
        specs: adapters and weights (default 1.0).
        out: the directory to create; must not exist.
        dtype: write floating tensors in this dtype (default: as stored).
        quantization: "4bit"/"8bit" if the adapters were trained on a quantized base (default: their manifests).
        requantize: write the merged model quantized like the base instead of 16/32-bit; the report
            gives the relative error this adds (`requantize.requantize_checkpoint`).
    """
    ensure_free(out)
    source_dir, ledger = _source(base)
    adapters: dict[str, Adapter] = {}
    target = ledger
    for spec in specs:
        adapter = _read_spec(spec, Ledger(), allow_pickle)
        _check_new(adapter, ledger, source_dir, force)
        adapters[adapter.name] = adapter
        target = target.plus(adapter.name, 1.0 if spec.weight is None else spec.weight, adapter)
    if quantization is None:
        recorded = {a.manifest.base.quantization for a in adapters.values() if a.manifest is not None}
        quantization = recorded.pop() if len(recorded) == 1 else ledger.base_quantization
    if ledger.entries and quantization != ledger.base_quantization:
        raise AdapterError(
            f"{source_dir} holds merges on a {ledger.base_quantization} base; cannot add {quantization} ones"
        )
    target = replace(target, base_quantization=quantization)
    if requantize and quantization == "none":
        raise AdapterError("--requantize needs adapters trained on a 4bit or 8bit base (or --quantization 4bit|8bit)")
    plan = _plan(source_dir, ledger, target, adapters, base=None, force=force, allow_pickle=allow_pickle)
    if not requantize:
        return _execute(plan, out, "merge", dtype=dtype)
    from finetune.adapters.requantize import requantize_checkpoint

    out = Path(out)
    dense_dir = out.parent / f".{out.name}.dense-{os.getpid()}"
    shutil.rmtree(dense_dir, ignore_errors=True)
    try:
        report = _execute(plan, dense_dir, "merge", dtype=dtype)
        errors = requantize_checkpoint(dense_dir, out, quantization, _quantization_options(plan.adapters))
    finally:
        shutil.rmtree(dense_dir, ignore_errors=True)
    worst = max(errors, key=lambda name: errors[name])
    report.out = out
    report.notes = [n for n in report.notes if not n.startswith("dequantized the")]
    report.notes.append(
        f"requantized to {quantization}: relative Frobenius error added {errors[worst]:.3e} at worst ({worst}), "
        f"{sum(errors.values()) / len(errors):.3e} on average over {len(errors)} layers"
    )
    return report


def subtract_checkpoint(
    model: str,
    spec: AdapterSpec,
    out: str | Path,
    *,
    base: str | None = None,
    negate: bool = False,
    force: bool = False,
    allow_pickle: bool = False,
) -> DiskReport:
    """Take an adapter out of a merged model: exact from the base when it is found, else fp32 arithmetic."""
    ensure_free(out)
    source_dir, ledger = _source(model)
    adapter = _read_spec(spec, ledger, allow_pickle)
    if adapter.name not in ledger.entries:
        _check_new(adapter, ledger, source_dir, force)
    target = ledger.minus(adapter.name, spec.weight, adapter, negate=negate, where=str(source_dir))
    plan = _plan(source_dir, ledger, target, {adapter.name: adapter}, base=base, force=force, allow_pickle=allow_pickle)
    if adapter.name not in ledger.entries:
        plan.notes.append(f"task negation: {adapter.name!r} was never merged into {source_dir}")
    return _execute(plan, out, "subtract", dtype=None)


def swap_checkpoint(
    model: str,
    remove: AdapterSpec,
    add: AdapterSpec,
    out: str | Path,
    *,
    base: str | None = None,
    force: bool = False,
    allow_pickle: bool = False,
) -> DiskReport:
    """Replace merged adapter `remove` by `add`: with the base at hand, equal to a fresh merge of `add`."""
    ensure_free(out)
    source_dir, ledger = _source(model)
    old = _read_spec(remove, ledger, allow_pickle)
    new = _read_spec(add, Ledger(), allow_pickle)
    _check_new(new, ledger, source_dir, force)
    if old.name not in ledger.entries:
        held = ", ".join(sorted(ledger.entries)) or "nothing"
        raise AdapterError(f"cannot swap out {old.name!r}: {source_dir} holds {held}")
    target = ledger.minus(old.name, None, old, negate=False).plus(
        new.name, 1.0 if add.weight is None else add.weight, new
    )
    plan = _plan(
        source_dir, ledger, target, {old.name: old, new.name: new}, base=base, force=force, allow_pickle=allow_pickle
    )
    return _execute(plan, out, "swap", dtype=None)
