"""`finetune.load_model`: a base model with named adapters, ready for exact merge/subtract/swap and `use`.

It resolves the base (`finetune.adapters.resolved_base`: directly, from an adapter's manifest, or from
the ledger of a merged checkpoint, whose merges it then continues exactly from the recorded base), loads
it on the device asked for (a GPU when there is one), checks every adapter against the base's
fingerprint, loads the tokenizer each adapter carries (the one its run trained with, checked to share the
base's vocabulary), and hands over to `finetune.adapters.inmemory.LoadedModel`, whose `tokenizer` is then the
adapter in use's (its chat template) or the base's.

This module is the inference half of the Python API: it imports nothing of training (no loop,
objectives, sharding, trackers or deepspeed), so `generate`, `eval` and `serve` start without them.
`finetune.train` lives in `finetune.training.loop`; the package exposes both lazily (see
`finetune/__init__.py`), so torch and transformers load with the first model, not with the package.

Example:
    m = finetune.load_model("models/tiny", adapters={"legal": "adapters/legal", "med": "adapters/med"})
    m.merge("legal", 0.5); m.merged                 # {'legal': 0.5}
    m.swap("legal", "med"); m.save_merged("merged/med")
    m = finetune.load_model("adapters/legal")       # the base comes from the adapter's manifest; in use, unmerged
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from finetune.adapters.fit import check_fingerprint
from finetune.adapters.inmemory import LoadedModel
from finetune.adapters.lora import Adapter, read_adapter, recorded_quantization
from finetune.adapters.resolved_base import ResolvedBase, resolve_base
from finetune.errors import AdapterError, AdapterWarning
from finetune.fingerprint import fingerprint_model
from finetune.model import load_adapter_tokenizer, load_base
from finetune.quantization import METHODS, Quantization

__all__ = ["load_model"]

DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_CONFIG_NAME = "adapter_config.json"


def _adopt_or_own(base: ResolvedBase, adapters: list[Adapter], allow_pickle: bool) -> ResolvedBase:
    """A merged checkpoint continues from the base its ledger records when that base and its adapters are at
    hand (appending those adapters to `adapters`); else it is a base of its own, with a warning."""
    ledger = base.ledger
    if not ledger.entries:  # a checkpoint everything was subtracted from, its recorded base gone: the weights at hand
        return base if base.pristine_dir is not None else replace(base, pristine_dir=base.weights_dir)
    problem = None
    if ledger.base_quantization != "none":
        problem = f"its adapters were merged into a dequantized {ledger.base_quantization} base"
    elif base.pristine_dir is None:
        problem = f"the base it records ({ledger.base_path}, {ledger.base_fingerprint}) is not available"
    found = []
    for name, entry in sorted(ledger.entries.items()):
        if problem is not None:
            break
        try:
            adapter = read_adapter(entry.path, name, allow_pickle=allow_pickle)
        except AdapterError as exc:
            problem = f"its adapter {name!r} cannot be read ({exc})"
            break
        if not entry.is_merged_form_of(adapter):
            problem = f"its adapter {name!r} at {entry.path} changed since it was merged"
        found.append(adapter)
    if problem is not None:
        warnings.warn(
            f"{base.weights_dir} holds merged adapters ({', '.join(ledger.weights)}) but {problem}; it is loaded as a "
            "base of its own (use `finetune adapters subtract` for fp32 arithmetic on it)",
            AdapterWarning,
            stacklevel=4,  # the caller of `load_model`
        )
        return base.as_own_base()
    for adapter in adapters:  # given under a name the ledger holds: it must be the adapter merged as that name
        if adapter.name in ledger.entries:
            ledger.check_same_adapter(adapter.name, adapter)
    given = {a.name for a in adapters}
    adapters.extend(a for a in found if a.name not in given)
    return base


def _named_paths(adapters: Mapping[str, str | Path] | Sequence[str | Path] | None) -> list[tuple[str | None, Path]]:
    if adapters is None:
        return []
    if isinstance(adapters, Mapping):
        return [(name, Path(path)) for name, path in adapters.items()]
    if isinstance(adapters, (str, Path)):
        return [(None, Path(adapters))]
    return [(None, Path(path)) for path in adapters]


def _read_adapters(
    base: str | Path, adapters: Mapping[str, str | Path] | Sequence[str | Path] | None, allow_pickle: bool
) -> tuple[str | Path, list[Adapter], str | None]:
    """(the base to load, the adapters read, the adapter to `use` first). When `base` is an adapter
    directory, it is read first, named `use` first, and its recorded base is loaded."""
    named = _named_paths(adapters)
    use_first = None
    if (Path(base) / ADAPTER_CONFIG_NAME).is_file():
        lead = read_adapter(base, allow_pickle=allow_pickle)
        if lead.base_path is None:
            raise AdapterError(
                f"adapter {base} records no base (no manifest, no base_model_name_or_path); pass the base"
            )
        named.insert(0, (lead.name, Path(base)))
        use_first, base = lead.name, lead.base_path
    return base, [read_adapter(path, name, allow_pickle=allow_pickle) for name, path in named], use_first


def _quantization(given: str | None, adapters: list[Adapter]) -> Quantization:
    """The base's quantization: as given, with the options the adapters recorded when they agree on it."""
    if given is None:
        return recorded_quantization(adapters) or Quantization()
    recorded = recorded_quantization(adapters, strict=False)  # the base is chosen: its options if they agree
    return recorded if recorded is not None and recorded.method == given else Quantization(given)  # type: ignore[arg-type]


def _load_resolved(
    resolved: ResolvedBase, *, dtype: str, requantize: bool, attn_implementation: str | None, trust_remote_code: bool
) -> LoadedModel:
    """Load the resolved base on its device, quantized as it says, into a `LoadedModel` (no adapters yet)."""
    model, tokenizer, _ = load_base(
        resolved.source,
        dtype=dtype,
        revision=resolved.revision,
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        quantization=resolved.quantization,
        device=resolved.device,
    )
    if resolved.fingerprint is None and resolved.quantization.method == "none":
        resolved = resolved.with_fingerprint(fingerprint_model(model))  # no files to take it from
    return LoadedModel(model, tokenizer, resolved, requantize=requantize)


def _add_adapters(loaded: LoadedModel, read: list[Adapter], where: str, force: bool, trust_remote_code: bool) -> None:
    """Add each adapter with the tokenizer it carries, after checking it was trained on this base."""
    for adapter in read:
        check_fingerprint(adapter, loaded.base.fingerprint, where, force=force)  # maybe taken from the weights
        tokenizer = load_adapter_tokenizer(adapter.path, loaded.base_tokenizer, trust_remote_code=trust_remote_code)
        loaded.add_adapter(adapter, tokenizer)


def load_model(
    base: str | Path,
    adapters: Mapping[str, str | Path] | Sequence[str | Path] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = None,
    requantize: bool = False,
    force: bool = False,
    allow_pickle: bool = False,
    revision: str | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device | None = "auto",
) -> LoadedModel:
    """Load a base and its adapters into a `LoadedModel`.

    Args:
        base: a model directory, hub id or `embedded:tiny-llama`; or an adapter directory, whose manifest
            (else `base_model_name_or_path`) names the base; that adapter is then switched on with `use`.
        adapters: name -> adapter directory (or a list of directories, named by manifest or directory).
        dtype: float32 | bfloat16 | float16, as a name or a `torch.dtype` (as transformers accepts): the
            model's dtype, and that of merged weights. Default: float32; on a base quantized as the adapters'
            runs quantized it, the dtype those runs loaded it in, which decides the quantized weights
            (transformers casts a checkpoint to it before bitsandbytes quantizes).
        quantization: none | 4bit | 8bit (bitsandbytes); default: what the adapters' manifests record.
            Merging into a quantized layer dequantizes it and writes a dense `dtype` layer.
        requantize: requantize merged layers instead (their added error is in `requantization_errors`).
        force: apply adapters whose recorded base fingerprint differs from this base's.
        allow_pickle: accept `adapter_model.bin` files (read with `torch.load(weights_only=True)`).
        device: where the model is loaded and every merge is computed: auto (CUDA when present, else the
            CPU), cpu, cuda or cuda:N.

    Raises:
        AdapterError: unreadable/unsafe adapters, fingerprint or shape mismatch, no base to be found.
        ModelError: the base cannot be loaded.
    """
    if quantization not in (None, *METHODS):
        raise AdapterError(f"quantization {quantization!r} is not one of {', '.join(METHODS)}")
    base, read, use_first = _read_adapters(base, adapters, allow_pickle)
    quantization_settings = _quantization(quantization, read)
    if dtype is None:
        dtype = quantization_settings.weight_dtype if quantization_settings.method != "none" else None
    dtype = str(dtype or "float32").removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    if dtype not in DTYPES:
        raise AdapterError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)} (names or torch dtypes)")
    resolved = resolve_base(
        base, quantization=quantization_settings, dtype=getattr(torch, dtype), device=device, revision=revision
    )
    resolved = _adopt_or_own(resolved, read, allow_pickle)
    loaded = _load_resolved(
        resolved, dtype=dtype, requantize=requantize, attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
    )  # fmt: skip
    _add_adapters(loaded, read, str(resolved.pristine_dir or resolved.source), force, trust_remote_code)
    if use_first is not None:
        loaded.use(use_first)
    return loaded
