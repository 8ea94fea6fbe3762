"""The ledger: which adapters are merged into a model, with what weight, on top of which base.

A merged model's touched tensors equal round(W_base + Σ wᵢ·ΔWᵢ), summed in fp32 over the ledger's
entries in sorted-name order (`canonical_terms`); merge, subtract and swap only edit the ledger and then
recompute the tensors whose terms changed, from the pristine base. The ledger travels with a merged
checkpoint in `config.json` (key `finetune_merged`) and in every shard's safetensors metadata (same JSON
string), so a later `subtract` or `swap` knows what it is undoing and where the base was.

Example:
    ledger = Ledger(base_path="models/tiny", base_fingerprint="sha256:...")
    ledger = ledger.plus("legal", 1.0, adapter)          # a new Ledger; this one is unchanged
    ledger.weights                                        # {'legal': 1.0}
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, replace
from pathlib import Path

from finetune.adapters.lora import validate_adapter_name
from finetune.errors import AdapterError

LEDGER_KEY = "finetune_merged"
LEDGER_FORMAT = "finetune-merged/1"
_ZERO_WEIGHT = 1e-12


def as_weight(weight: object) -> float:
    """A weight given as a number: from the Python API, `merge("legal", "0.5")` raised a bare TypeError from the
    arithmetic below ("unsupported operand type(s) for +: 'float' and 'str'")."""
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise AdapterError(f"adapter weight {weight!r} is not a number; give a weight such as 1, 0.5 or -1")
    return float(weight)


def clean_weight(weight: float) -> float:
    """A weight rounded to 12 significant digits, so 0.1 + 0.2 - 0.3 is recorded as 0, not 5.6e-17.

    The rounded value is the one both the ledger and the arithmetic use, so tensors still follow it exactly.
    """
    if not math.isfinite(float(weight)):
        raise AdapterError(f"adapter weight {weight!r} is not a finite number; give a weight such as 1, 0.5 or -1")
    return float(f"{float(weight):.12g}")


@dataclass(frozen=True)
class LedgerEntry:
    weight: float
    path: str = ""
    sha256: str = ""
    """sha256 of the adapter file, so a ledger can tell a retrained adapter from the one it merged."""
    scaling: str = ""
    """`Adapter.scaling_sha256` when merged: an edited alpha or rank pattern is another update from the same file.
    Empty in ledgers written before it was kept (their adapters are then told apart by the file alone)."""

    def is_merged_form_of(self, adapter) -> bool:
        """Whether `adapter` gives the updates this entry merged: the same weights file and the same scaling."""
        if self.sha256 and adapter.file_sha256 != self.sha256:
            return False
        return not self.scaling or adapter.scaling_sha256 == self.scaling


@dataclass(frozen=True)
class Ledger:
    base_path: str = ""
    base_fingerprint: str = ""
    entries: dict[str, LedgerEntry] = field(default_factory=dict)
    base_quantization: str = "none"
    """bitsandbytes quantization the merged adapters were trained on ("4bit", "8bit"); the base is dequantized."""

    @property
    def weights(self) -> dict[str, float]:
        """name -> weight, in canonical (sorted) order."""
        return {name: self.entries[name].weight for name in sorted(self.entries)}

    def plus(self, name: str, weight: float, adapter=None) -> Ledger:
        """The ledger after adding `weight` of adapter `name`; an entry whose weight reaches 0 disappears."""
        weight = as_weight(weight)
        entries = dict(self.entries)
        old = entries.get(name)
        if adapter is not None:
            adapter.check_mergeable()
            self.check_same_adapter(name, adapter)
        total = clean_weight((old.weight if old else 0.0) + weight)
        if abs(total) < _ZERO_WEIGHT:
            entries.pop(name, None)
        else:
            # absolute: the merged model is read again from other working directories
            path = str(Path(adapter.path).resolve()) if adapter is not None else (old.path if old else "")
            if adapter is not None:
                entries[name] = LedgerEntry(total, path, adapter.file_sha256, adapter.scaling_sha256)
            else:
                entries[name] = replace(old, weight=total) if old else LedgerEntry(weight=total)
        return replace(self, entries=entries)

    def check_same_adapter(self, name: str, adapter) -> None:
        """Refuse an adapter whose weights file is not the one merged under `name`, or is one merged under
        another name: the arithmetic would take one for the other, or count one twice, without a word."""
        sha = adapter.file_sha256
        if not sha:
            return
        for other, entry in self.entries.items():
            if other == name and entry.sha256 and not entry.is_merged_form_of(adapter):
                if entry.path == str(Path(adapter.path).resolve()):
                    raise AdapterError(
                        f"adapter {name!r} at {entry.path} changed since it was merged (its weights, or the alpha or "
                        "rank in its adapter_config.json); restore it, or give --base to rebuild from the base"
                    )
                raise AdapterError(
                    f"adapter {name!r} merged here came from {entry.path}, and {adapter.path} is another adapter of "
                    "that name (other weights, or another alpha or rank in its adapter_config.json); give one of them "
                    "another name, or restore the config it was merged with"
                )
            if other != name and entry.sha256 == sha:
                raise AdapterError(
                    f"{adapter.path} is the adapter merged here as {other!r}; adding it as {name!r} too would count "
                    f"it twice (change {other!r}'s weight instead)"
                )

    def minus(self, name: str, weight: float | None, adapter=None, *, negate: bool, where: str = "the model") -> Ledger:
        """The ledger after subtracting `weight` of `name` (default: all that is merged).

        Taking out more than is merged, or an adapter that is not merged at all, is task negation
        (removing an update the model never had) and needs `negate`.
        """
        merged = self.entries[name].weight if name in self.entries else 0.0
        weight = (merged if merged else 1.0) if weight is None else as_weight(weight)
        remaining = merged - weight
        if not negate and (merged == 0.0 or remaining * merged < 0):
            held = ", ".join(f"{n}:{w:g}" for n, w in self.weights.items()) or "nothing"
            raise AdapterError(
                f"{where} holds {held}, so subtracting {weight:g} of {name!r} would be task negation (removing an update "
                "it never had); pass --negate (negate=True) if that is the intent"
            )
        return self.plus(name, -weight, adapter)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": LEDGER_FORMAT,
                "base": {
                    "path": self.base_path,
                    "fingerprint": self.base_fingerprint,
                    "quantization": self.base_quantization,
                },
                "adapters": {
                    name: {"weight": e.weight, "path": e.path, "sha256": e.sha256, "scaling": e.scaling}
                    for name, e in sorted(self.entries.items())
                },
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | dict, where: str = "ledger") -> Ledger:
        try:
            data = json.loads(text) if isinstance(text, str) else text
            entries = {
                name: LedgerEntry(float(e["weight"]), e.get("path", ""), e.get("sha256", ""), e.get("scaling", ""))
                for name, e in data["adapters"].items()
            }
            base = data["base"]
            for name, entry in entries.items():  # names become module keys and file names: nothing may escape
                validate_adapter_name(name)
                if not math.isfinite(entry.weight):
                    raise ValueError(f"adapter {name!r} has weight {entry.weight}")
            return cls(base.get("path", ""), base.get("fingerprint", ""), entries, base.get("quantization", "none"))
        except AdapterError as exc:
            raise AdapterError(f"{where}: the merge ledger names an invalid adapter: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise AdapterError(
                f"{where}: the merge ledger is malformed ({exc!r}); re-create the merged model"
            ) from None


def read_ledger(model_dir: str | Path) -> Ledger | None:
    """The ledger of a merged model directory (from config.json), or None for a model nobody merged into."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if LEDGER_KEY not in config:
        return None
    return Ledger.from_json(config[LEDGER_KEY], where=str(config_file))
