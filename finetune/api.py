"""`finetune.load_model`: a base model with named adapters, ready for exact merge/subtract/swap and `use`.

It resolves the base (directly, from an adapter's manifest, or from the ledger of a merged checkpoint,
whose merges it then continues exactly from the recorded base), checks every adapter against the base's
fingerprint, and hands over to `finetune.adapters.inmemory.LoadedModel`.

Example:
    m = finetune.load_model("models/tiny", adapters={"legal": "adapters/legal", "med": "adapters/med"})
    m.merge("legal", 0.5); m.merged                 # {'legal': 0.5}
    m.swap("legal", "med"); m.save_merged("merged/med")
    m = finetune.load_model("adapters/legal")       # the base comes from the adapter's manifest; in use, unmerged
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from finetune.errors import AdapterError, AdapterWarning
from finetune.fingerprint import check_fingerprint, fingerprint_model, fingerprint_model_dir
from finetune.paths import local_model_dir

if TYPE_CHECKING:  # torch and transformers load when a model does, so `import finetune` stays instant
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from finetune.adapters.inmemory import LoadedModel
    from finetune.adapters.ledger import Ledger
    from finetune.adapters.lora import Adapter

__all__ = ["load_model"]

DTYPES = ("float32", "bfloat16", "float16")
ADAPTER_CONFIG_NAME = "adapter_config.json"


def _adoptable_ledger(model_dir: Path | None, adapters: list[Adapter], allow_pickle: bool) -> Ledger | None:
    """The ledger of a merged checkpoint if its base and adapters are at hand (appending those adapters to
    `adapters`), else None with a warning: the checkpoint then counts as a base of its own."""
    from finetune.adapters.ledger import read_ledger
    from finetune.adapters.lora import read_adapter

    ledger = read_ledger(model_dir) if model_dir is not None else None
    if ledger is None or not ledger.entries:
        return None
    problem = None
    base_dir = local_model_dir(ledger.base_path)
    if ledger.base_quantization != "none":
        problem = f"its adapters were merged into a dequantized {ledger.base_quantization} base"
    elif base_dir is None or fingerprint_model_dir(base_dir) != ledger.base_fingerprint:
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
        if entry.sha256 and adapter.file_sha256 != entry.sha256:
            problem = f"its adapter {name!r} at {entry.path} changed since it was merged"
        found.append(adapter)
    if problem is not None:
        warnings.warn(
            f"{model_dir} holds merged adapters ({', '.join(ledger.weights)}) but {problem}; it is loaded as a base of "
            "its own (use `finetune adapters subtract` for fp32 arithmetic on it)",
            AdapterWarning,
            stacklevel=4,  # the caller of `load_model`
        )
        return None
    given = {a.name for a in adapters}
    adapters.extend(a for a in found if a.name not in given)
    return ledger


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
    from finetune.adapters.lora import read_adapter  # imports torch: loaded with a model, not with `finetune`

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


def _base_fingerprint(model: PreTrainedModel, base_dir: Path | None, quantization: str) -> str | None:
    """The base's fingerprint: of its files when at hand, else of the loaded (unquantized) weights, else None."""
    if base_dir is not None and any(base_dir.glob("*.safetensors")):
        return fingerprint_model_dir(base_dir)
    if quantization == "none":
        return fingerprint_model(model)
    return None


def _recorded_quantization(read: list[Adapter]) -> str:
    recorded = {a.manifest.base.quantization for a in read if a.manifest is not None}
    return recorded.pop() if len(recorded) == 1 else "none"


class _Base(NamedTuple):
    """A loaded base, and the base the adapter arithmetic starts from (`dir`, `fingerprint`, `ledger`)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str
    dir: Path | None
    fingerprint: str | None
    ledger: Ledger | None


def _load_base(
    base: str | Path,
    read: list[Adapter],
    allow_pickle: bool,
    *,
    quantization: str,
    revision: str | None,
    **options: Any,
) -> _Base:
    """Load `base`; a merged checkpoint whose ledger can be adopted continues from the base it records."""
    from finetune.model import load_base  # imports transformers: with the model, not with `import finetune`

    model, tokenizer, source = load_base(str(base), quantization=quantization, revision=revision, **options)
    base_dir = local_model_dir(source, revision)
    ledger = _adoptable_ledger(base_dir, read, allow_pickle)
    if ledger is not None:
        return _Base(model, tokenizer, source, Path(ledger.base_path), ledger.base_fingerprint, ledger)
    return _Base(model, tokenizer, source, base_dir, _base_fingerprint(model, base_dir, quantization), None)


def load_model(
    base: str | Path,
    adapters: Mapping[str, str | Path] | Sequence[str | Path] | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    quantization: str | None = None,
    requantize: bool = False,
    force: bool = False,
    allow_pickle: bool = False,
    revision: str | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a base and its adapters into a `LoadedModel`.

    Args:
        base: a model directory, hub id or `embedded:tiny-llama`; or an adapter directory, whose manifest
            (else `base_model_name_or_path`) names the base; that adapter is then switched on with `use`.
        adapters: name -> adapter directory (or a list of directories, named by manifest or directory).
        dtype: float32 | bfloat16 | float16, as a name or a `torch.dtype` (as transformers accepts): the
            model's dtype, and that of merged weights.
        quantization: none | 4bit | 8bit (bitsandbytes); default: what the adapters' manifests record.
            Merging into a quantized layer dequantizes it and writes a dense `dtype` layer.
        requantize: requantize merged layers instead (their added error is in `requantization_errors`).
        force: apply adapters whose recorded base fingerprint differs from this base's.
        allow_pickle: accept `adapter_model.bin` files (read with `torch.load(weights_only=True)`).

    Raises:
        AdapterError: unreadable/unsafe adapters, fingerprint or shape mismatch, no base to be found.
        ModelError: the base cannot be loaded.
    """
    import torch  # with the model, not with `import finetune`

    from finetune.adapters.inmemory import LoadedModel

    dtype = str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    if dtype not in DTYPES:
        raise AdapterError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)} (names or torch dtypes)")
    base, read, use_first = _read_adapters(base, adapters, allow_pickle)
    if quantization is None:  # what the adapters were trained on, when they agree
        quantization = _recorded_quantization(read)
    options = dict(dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    loaded_base = _load_base(base, read, allow_pickle, quantization=quantization, revision=revision, **options)
    loaded = LoadedModel(
        loaded_base.model,
        loaded_base.tokenizer,
        base_source=loaded_base.source,
        base_dir=loaded_base.dir,
        base_fingerprint=loaded_base.fingerprint or "",
        dtype=getattr(torch, dtype),
        requantize=requantize,
        quantization=quantization,
        ledger=loaded_base.ledger,
    )
    for adapter in read:
        check_fingerprint(adapter, loaded_base.fingerprint, str(loaded_base.dir or loaded_base.source), force=force)
        loaded.add_adapter(adapter)
    if use_first is not None:
        loaded.use(use_first)
    return loaded
