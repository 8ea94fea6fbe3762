"""The one value every operation on base weights starts from, built by one function: `resolve_base`.

Loading a model with adapters (`finetune.load_model`), merging a checkpoint on disk, serving and
exporting all need the same answers before they touch a tensor: which weights are at hand (a directory,
or a hub id), what they already hold merged and over which pristine base (the ledger, the base found by
its recorded fingerprint), how that base is quantized, in which dtype and on which device the
arithmetic runs. `ResolvedBase` holds those answers; `PristineWeights` serves the pristine tensors on
`device`, and every update is computed there (`arithmetic.merged_weight`).

What each path does when the pristine base of a merged checkpoint is missing is its own policy: on
disk the arithmetic falls back to fp32 on the merged weights (and reports the drift); in memory the
checkpoint is loaded as a base of its own (`as_own_base`).

Example:
    base = resolve_base("merged/legal", device="auto")
    base.ledger.weights        # {'legal': 1.0}: what the weights at hand hold
    base.pristine_dir          # the base they were merged into, checked by fingerprint (None: not at hand)
    base.device                # cuda:0 on a GPU machine
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from finetune.adapters.ledger import Ledger, read_ledger
from finetune.device import resolve_device
from finetune.embedded.cache import resolve_base_id
from finetune.errors import AdapterError, ModelError
from finetune.fingerprint import fingerprint_model_dir, weight_files
from finetune.paths import local_model_dir
from finetune.quantization import Quantization
from finetune.tensorfile import check_safetensors


@dataclass(frozen=True)
class ResolvedBase:
    """Which weights are at hand, what they hold, the pristine base under them, and where to compute.

    Attributes:
        source: the weights at hand as named (a directory, or a hub id: what adapters record).
        weights_dir: that local directory (None: a hub id that is not in the local cache).
        ledger: what the weights hold merged, over which base (path, fingerprint, quantization); for a
            plain base, an empty ledger over itself.
        pristine_dir: the pristine base's directory: the weights themselves when nothing is merged; None
            when a merged checkpoint's base is not at hand.
        quantization: how the base is (or was, for adapters trained on it) quantized by bitsandbytes.
        dtype: the dtype merged tensors are written in (None on disk: as each tensor is stored).
        device: where base tensors are put and every update is computed.
        notes: what resolving found worth saying (a forced fingerprint mismatch, a base not at hand).
    """

    source: str
    weights_dir: Path | None
    ledger: Ledger
    pristine_dir: Path | None
    quantization: Quantization
    dtype: torch.dtype | None
    device: torch.device
    revision: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def fingerprint(self) -> str | None:
        """The pristine base's fingerprint (None when it has no safetensors files to take it from)."""
        return self.ledger.base_fingerprint or None

    @classmethod
    def in_memory(cls, model: torch.nn.Module, name: str = "in memory") -> ResolvedBase:
        """A base that exists only as a model in memory (no files): touched tensors are kept as copies."""
        weight = next(model.parameters())
        return cls(name, None, Ledger(name, ""), None, Quantization(), weight.dtype, weight.device)

    @property
    def weights_fingerprint(self) -> str | None:
        """The fingerprint of the weights at hand: the base's when nothing is merged, else the checkpoint's own
        (what an adapter trained on these weights records)."""
        if not self.ledger.entries:
            return self.fingerprint
        return _fingerprint_of(self.weights_dir) or None

    def as_own_base(self) -> ResolvedBase:
        """The weights at hand taken as a base of their own (a merged checkpoint whose ledger is not used)."""
        assert self.weights_dir is not None, "only a local checkpoint holds merges"
        fingerprint = _fingerprint_of(self.weights_dir)
        ledger = Ledger(str(self.weights_dir), fingerprint, base_quantization=self.quantization.method)
        return replace(self, ledger=ledger, pristine_dir=self.weights_dir)

    def with_fingerprint(self, fingerprint: str | None) -> ResolvedBase:
        """The same base with the fingerprint taken from the loaded weights (a base without files here)."""
        return replace(self, ledger=replace(self.ledger, base_fingerprint=fingerprint or ""))


def resolve_base(
    ref: str | Path,
    *,
    pristine: str | None = None,
    force: bool = False,
    quantization: Quantization | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = "auto",
    revision: str | None = None,
) -> ResolvedBase:
    """Resolve `ref` (a model directory, a merged checkpoint, `embedded:*` or a hub id) into a `ResolvedBase`.

    Args:
        pristine: the pristine base to use for a merged checkpoint (default: the one its ledger records).
        force: accept a pristine base whose fingerprint differs from the recorded one (noted).
        quantization: the base's quantization (default: the ledger's, else none).
        dtype, device, revision: as `ResolvedBase` holds them; `device` "auto" is CUDA when present.

    Raises:
        AdapterError: `pristine` was given and is not a model directory, or a base's fingerprint differs
            from the recorded one without `force`.
    """
    source = resolve_base_id(str(ref))
    weights_dir = local_model_dir(source, revision)
    weights_dir = weights_dir.resolve() if weights_dir is not None else None  # ledgers record absolute paths
    ledger = read_ledger(weights_dir) if weights_dir is not None else None
    if ledger is None:
        method = (quantization or Quantization()).method
        ledger = Ledger(str(weights_dir or source), _fingerprint_of(weights_dir), base_quantization=method)
    pristine_dir, notes = _find_pristine_base(weights_dir, ledger, pristine, force)
    return ResolvedBase(
        source=source,
        weights_dir=weights_dir,
        ledger=ledger,
        pristine_dir=pristine_dir,
        quantization=quantization or Quantization(ledger.base_quantization),  # type: ignore[arg-type]
        dtype=dtype,
        device=resolve_device(device),
        revision=revision,
        notes=tuple(notes),
    )


def resolve_model_dir(ref: str) -> Path:
    """A local model directory with whole safetensors weights for `ref` (a path, `embedded:*`, or a cached hub id).

    Every weight file's header is checked here, the one gate of the on-disk arithmetic's source model (a merged one
    included, whose files the fingerprint of a plain base never reads) and of its pristine base: a file cut short
    by a full disk or a killed copy is one error naming it, not safetensors' traceback when the stream opens it.

    Raises:
        AdapterError: not a model directory, or no safetensors weights.
        ModelError: a weight file is not whole (truncated, a Git LFS pointer).
    """
    directory = local_model_dir(resolve_base_id(ref))
    if directory is None or not (directory / "config.json").is_file():
        raise AdapterError(f"{ref} is not a model directory (no config.json) nor a cached hub model; give a local path")
    files = weight_files(directory)
    if not files:
        raise AdapterError(f"{directory} holds no *.safetensors weights; re-save it with save_pretrained (safetensors)")
    for file in files:
        check_safetensors(file, ModelError, "re-create, re-download or re-copy that model")
    return directory


def _fingerprint_of(model_dir: Path | None) -> str:
    """The fingerprint of a directory's safetensors weights; '' when it has none (taken from the model later).

    Raises:
        ModelError: a weight file is not whole (truncated, a Git LFS pointer): found from its header first.
    """
    files = weight_files(model_dir) if model_dir is not None else []
    for file in files:
        check_safetensors(file, ModelError, "re-download or re-save the base model")
    return fingerprint_model_dir(model_dir) if files and model_dir is not None else ""


def _find_pristine_base(
    weights_dir: Path | None, ledger: Ledger, pristine: str | None, force: bool
) -> tuple[Path | None, list[str]]:
    """The base to recompute tensors from (checked against the ledger's fingerprint), or None, and notes on why.

    A checkpoint whose ledger holds no adapters is its own pristine base only when the ledger names it: one left by
    subtracting every adapter records the base it came from, and holds that base as rounded to its dtype (or, over
    a 4-/8-bit base, dequantized), not the base's values; taken as its own base, a later merge quantized those
    dequantized weights again (up to 2.4e-4 away from a fresh merge on the tiny base) and reported itself exact.
    """
    if not ledger.entries and pristine is None and not _records_another_base(weights_dir, ledger):
        return weights_dir, []  # nothing merged: the weights are their own pristine base
    candidate = pristine or ledger.base_path
    try:
        pristine_dir = resolve_model_dir(candidate) if candidate else None
    except AdapterError:
        if pristine is not None:
            raise
        return None, [f"the recorded base {candidate} is not available"]
    notes: list[str] = []
    if pristine_dir is not None and ledger.base_fingerprint:
        found = fingerprint_model_dir(pristine_dir)
        if found != ledger.base_fingerprint:
            message = (
                f"{pristine_dir} ({found}) is not the base {weights_dir} was merged from "
                f"({ledger.base_path}, {ledger.base_fingerprint}); pass the right --base or --force"
            )
            if not force:
                raise AdapterError(message)
            notes.append("forced: " + message)
    return pristine_dir, notes


def _records_another_base(weights_dir: Path | None, ledger: Ledger) -> bool:
    """Whether the ledger names a base other than the weights themselves (a checkpoint written by a subtract)."""
    if weights_dir is None or not ledger.base_path:
        return False
    return Path(ledger.base_path).resolve() != weights_dir.resolve()
