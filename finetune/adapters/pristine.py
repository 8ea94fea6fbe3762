"""The one provider of base weights W_base for every merge, subtract and swap, in memory and on disk.

`arithmetic.merged_weight` computes round(W_base + Σ wᵢ·ΔWᵢ); this module decides what W_base is, in
the same way for both paths, from three sources:

- **the base's files** (preferred): the tensor read from its safetensors file through the
  `TensorIndex`, memory-mapped, so exact restoration costs no second copy of the model (pages are read
  when a tensor is recomputed and can be dropped afterwards). Tied weights the files store once are read
  under the stored name (`aliases`). For adapters trained on a quantized base, linear weights go through
  the quantize → dequantize round trip (`roundtrip`), which equals what the quantized layer computes with;
- **a quantized layer in memory**: its dequantized weight (`remember_quantized`);
- **a kept copy**: in memory, when the files cannot give the tensor the model holds (no files, a hub
  model not in the local cache, names `from_pretrained` converts), a copy of that tensor alone, taken
  at first touch; `copied_bytes` says what that costs.

In memory, `remember(name, tensor)` is called at a tensor's first touch and decides its source (file if
equal to the model's tensor, else a copy); on disk there is nothing to remember: every tensor comes
from the files.

Every tensor it gives is on the base's device (`device`): file tensors are read memory-mapped and moved
there, a quantized layer is dequantized where it lives, a kept copy stays where it was taken. So the
update added to it (`arithmetic.merged_weight`) is computed there too.

Example:
    pristine = PristineWeights.of("models/tiny", torch.device("cuda"))
    pristine.remember("model.layers.0.self_attn.q_proj.weight", current_tensor)   # in memory, at first touch
    base = pristine.get("model.layers.0.self_attn.q_proj.weight", torch.float32)   # bit-equal to that tensor
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from finetune.adapters import quantized
from finetune.adapters.expert_files import ExpertLayout
from finetune.adapters.tensor_index import TensorIndex
from finetune.errors import AdapterWarning
from finetune.quantization import Quantization

Roundtrip = Callable[[str, torch.Tensor, torch.dtype], torch.Tensor]
"""(name, file tensor as stored, dtype asked for) -> the weight the quantized base computes with (for names it
leaves dense: the tensor in that dtype)."""


class PristineWeights:
    """Base tensors by checkpoint name, from files, dequantized layers or kept copies (see the module docstring)."""

    def __init__(
        self,
        index: TensorIndex | None,
        *,
        device: torch.device,
        verify: bool = True,
        aliases: dict[str, str] | None = None,
        roundtrip: Roundtrip | None = None,
        layout: ExpertLayout | None = None,
    ):
        """Args:
        index: the base's tensors, or None when it has no files here.
        device: where file tensors are put (and their quantization round trip computed): the base's device.
        verify: in memory, take a file tensor only if it equals the model's at first touch; False when
            the model already holds merges (loaded from a merged checkpoint whose ledger names this base).
        aliases: name -> the name the files store its values under (tied weights: `lm_head.weight` ->
            `model.embed_tokens.weight`).
        roundtrip: applied to file tensors (adapters trained on a quantized base; see `quantization_roundtrip`).
        layout: fused expert tensors the files store one per expert, assembled from their parts when asked for.
        """
        self._index = index
        self._device = device
        self._verify = verify
        self._aliases = dict(aliases or {})
        self._roundtrip = roundtrip
        self.layout = layout
        self._copies: dict[str, torch.Tensor] = {}
        self._quantized: dict[str, torch.nn.Module] = {}
        self._from_file: set[str] = set()

    @classmethod
    def of(
        cls, base_dir: str | Path | None, device: torch.device, model: torch.nn.Module | None = None, **options
    ) -> PristineWeights:
        """The provider for a base directory (None, or a directory without safetensors files: copies only);
        `model` (its architecture) tells it how the files store fused expert tensors."""
        index = TensorIndex.of(base_dir) if base_dir is not None and Path(base_dir).is_dir() else None
        layout = ExpertLayout(model, index) if model is not None and index else None
        return cls(index, device=device, layout=layout, **options)

    @property
    def copied_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._copies.values())

    def stored_name(self, name: str) -> str | None:
        """The name the files hold `name`'s values under, or None when they do not hold it."""
        if self._index is None:
            return None
        if name in self._index or (self.layout is not None and name in self.layout.fused):
            return name
        alias = self._aliases.get(name)
        return alias if alias in self._index else None

    def _from_files(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        stored = self.stored_name(name)
        if stored is None:
            return None
        assert self._index is not None
        if self.layout is not None and stored in self.layout.fused:
            tensor = self.layout.read(stored, self._index.read, dtype, self._device)
        else:  # as stored: the round trip quantizes from the dtype training loaded, not from `dtype`
            tensor = self._index.read(stored).to(device=self._device)
        return self._roundtrip(name, tensor, dtype) if self._roundtrip is not None else tensor.to(dtype)

    def remember(self, name: str, current: torch.Tensor) -> None:
        """Record the pristine value of `name` at its first touch: `current` must not hold any merge yet."""
        if name in self._from_file or name in self._copies:
            return
        from_file = self._from_files(name, current.dtype)
        if (
            from_file is not None
            and from_file.shape == current.shape
            and (not self._verify or torch.equal(from_file.to(current.device), current.detach()))
        ):
            self._from_file.add(name)
            return
        self._copies[name] = current.detach().clone()
        why = "it differs from the base files" if from_file is not None else "the base has no safetensors files here"
        warnings.warn(
            f"keeping an in-memory copy of {name} ({current.numel() * current.element_size() / 2**20:.1f} MiB) for exact "
            f"restoration because {why}",
            AdapterWarning,
            stacklevel=4,
        )

    def remember_quantized(self, name: str, layer: torch.nn.Module) -> None:
        """Record a quantized layer (in memory) whose dequantized weight is `name`'s base value."""
        self._quantized.setdefault(name, layer)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The base value of `name`: a dequantized layer's weight (on its device), a kept copy (where it was
        taken), or the file's tensor in `dtype` on the provider's device."""
        if name in self._quantized:
            return quantized.dequantize(self._quantized[name])
        if name in self._copies:
            return self._copies[name]
        tensor = self._from_files(name, dtype)
        if tensor is None:
            raise KeyError(f"{name}: not in the base's files and never remembered")
        return tensor


def quantization_roundtrip(quantizable: set[str], quantization: Quantization) -> Roundtrip:
    """The file-side twin of a quantized layer: W -> dequantize(quantize(W)) for the names bitsandbytes
    quantizes, computed on the tensor's device (where the in-memory base would have been quantized).

    W is first cast to the dtype the adapters' run loaded the base in (`Quantization.weight_dtype`), as
    transformers casts it before bitsandbytes quantizes; when that is unknown, to the dtype asked for. A
    float32 checkpoint trained on in bfloat16 and quantized from float32 gave weights 0.2 away from those
    the adapter learned against (tiny base, nf4)."""
    source_dtype = getattr(torch, quantization.weight_dtype) if quantization.weight_dtype else None

    def roundtrip(name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if name not in quantizable:
            return weight.to(dtype)
        layer = quantized.quantized_linear(weight.to(source_dtype or dtype), quantization)
        return quantized.dequantize(layer)

    return roundtrip
