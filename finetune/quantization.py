"""How a base is quantized by bitsandbytes: one value, written once, read by training and by the arithmetic.

Training loads a base 4-bit (QLoRA) or 8-bit; an adapter trained on it learned its update against the
*dequantized* weights, so every later merge must reproduce those weights: load the base the same way
(in memory), or quantize and dequantize the stored weights the same way (on disk). Both read the
settings from here, so the defaults (nf4, double quantization) exist in one place and an adapter's
manifest gives back exactly the settings its run used.

Example:
    Quantization.of(recipe.model)                              # from a recipe's `model` section
    Quantization("4bit").bnb_config(compute_dtype=torch.bfloat16)   # transformers' BitsAndBytesConfig
    Quantization.from_record({"quantization": "4bit", "bnb_4bit_quant_type": "fp4"})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    import torch

Method = Literal["none", "4bit", "8bit"]
METHODS: tuple[str, ...] = get_args(Method)
QuantType = Literal["nf4", "fp4"]


@dataclass(frozen=True)
class Quantization:
    """bitsandbytes settings of a base (the `model.quantization` and `model.bnb_4bit_*` recipe fields).

    Attributes:
        method: none | 4bit | 8bit.
        quant_type: 4-bit data type, nf4 (QLoRA's) or fp4.
        double_quant: quantize the 4-bit blocks' scales too (QLoRA's double quantization).
        compute_dtype: dtype 4-bit layers dequantize to for each matmul; None: the model's dtype.
        weight_dtype: dtype the weights were loaded in when bitsandbytes quantized them (the training run's
            `model.dtype`, from an adapter's manifest); None: unknown. It changes the quantized weights: a float32
            checkpoint loaded in bfloat16 rounds to other nf4 codes and absmax scales than loaded in float32
            (0.07 apart at worst on the tiny base's q_proj, as far as the nf4 error itself), so the on-disk round
            trip quantizes from it (`pristine.quantization_roundtrip`). Not a recipe field: `as_record` omits it.
    """

    method: Method = "none"
    quant_type: QuantType = "nf4"
    double_quant: bool = True
    compute_dtype: str | None = None
    weight_dtype: str | None = None

    @property
    def bits(self) -> int | None:
        return {"4bit": 4, "8bit": 8}.get(self.method)

    @classmethod
    def of(cls, model_config: Any) -> Quantization:
        """The settings of a recipe's `model` section (a `ModelConfig`, or its dict as a manifest records it)."""
        fields = model_config if isinstance(model_config, Mapping) else vars(model_config)
        return cls.from_record(fields)

    @classmethod
    def from_record(cls, fields: Mapping[str, Any]) -> Quantization:
        """From recipe-style keys (`quantization`, `bnb_4bit_quant_type`, ...); absent keys take the defaults."""
        default = cls()
        return cls(
            method=fields.get("quantization") or default.method,
            quant_type=fields.get("bnb_4bit_quant_type") or default.quant_type,
            double_quant=fields.get("bnb_4bit_use_double_quant", default.double_quant),
            compute_dtype=fields.get("bnb_4bit_compute_dtype") or default.compute_dtype,
        )

    def as_record(self) -> dict[str, Any]:
        """The recipe-style keys `from_record` reads back (a combined adapter's manifest keeps them)."""
        return {
            "quantization": self.method,
            "bnb_4bit_quant_type": self.quant_type,
            "bnb_4bit_use_double_quant": self.double_quant,
            "bnb_4bit_compute_dtype": self.compute_dtype,
        }

    def bnb_config(self, compute_dtype: torch.dtype):
        """transformers' `BitsAndBytesConfig` for loading a base this way (None when not quantized).

        `compute_dtype` is used when the settings name none (the model's dtype, as QLoRA recipes expect).
        """
        if self.method == "none":
            return None
        import torch
        from transformers import BitsAndBytesConfig  # transformers loads with a model, not with the recipe

        if self.method == "8bit":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype) if self.compute_dtype else compute_dtype,
        )

    def describe(self) -> str:
        """'none', '8-bit' or '4-bit nf4 (double quantization)' for logs and reports."""
        if self.method == "none":
            return "none"
        if self.method == "8bit":
            return "8-bit"
        return f"4-bit {self.quant_type}" + (" (double quantization)" if self.double_quant else "")


NO_QUANTIZATION = Quantization()
"""A dense base (the default everywhere a quantization is optional)."""
