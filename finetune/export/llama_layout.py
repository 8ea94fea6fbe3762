"""The Llama family as llama.cpp expects it in GGUF: supported architectures, hyperparameters, tensor names, q/k rows.

Hugging Face's Llama applies rotary embeddings with `rotate_half`: within each head of width d it rotates
the pair (dim i, dim i + d/2). llama.cpp's Llama graph (`LLAMA_ROPE_TYPE_NORM`) rotates adjacent pairs
(2i, 2i + 1). The same attention therefore needs the rows of W_q and W_k (and their biases) reordered
inside every head from [x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}] to [x_0, y_0, x_1, y_1, ...]; the scores
q·k are unchanged because both sides move the same way. For a LoRA update B·A only B's rows move.

Tensor names come from the `gguf` package's own map (`gguf.get_tensor_name_map`), so they follow the
version of llama.cpp that package describes: `model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`.

Example:
    layout = read_layout(Path("merged/legal"))
    layout.gguf_name("model.layers.0.self_attn.q_proj.weight")      # 'blk.0.attn_q.weight'
    layout.to_llama_cpp("model.layers.0.self_attn.q_proj.weight", w) # rows permuted for llama.cpp's RoPE
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from finetune.errors import ExportError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
"""Hugging Face architectures exported as llama.cpp's `llama` architecture."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
GGUF_ARCH = "llama"


@dataclass(frozen=True)
class LlamaLayout:
    """A Llama-family model's shape, read from its config.json, and how its tensors map onto GGUF."""

    config: dict[str, Any]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: dict[str, Any]
    """`rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`, as one mapping."""
    sliding_window: int | None = None
    """Mistral's attention window when it is shorter than the context: llama.cpp's `llama` graph has none."""

    @property
    def context_length(self) -> int:
        """`llama.context_length`: the model's context, capped at a sliding window (see `_sliding_window`)."""
        return self.sliding_window or int(self.config.get("max_position_embeddings", 2048))

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def gguf_name(self, hf_name: str) -> str | None:
        """The GGUF tensor name of a Hugging Face tensor; None for one llama.cpp does not store (a tied lm_head).

        Raises:
            ExportError: a tensor the Llama layout has no place for.
        """
        import gguf

        if hf_name == "lm_head.weight" and self.tied_embeddings:
            return None  # llama.cpp reads the output projection from token_embd when output.weight is absent
        name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.num_layers)
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(
                f"tensor {hf_name} has no place in llama.cpp's Llama layout; is this a plain Llama model?"
            )
        return gguf_name

    def to_llama_cpp(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` with the row order llama.cpp's RoPE expects (q/k projections, weights and biases)."""
        module = hf_name.rsplit(".", 1)[0]
        if module.endswith("self_attn.q_proj"):
            return permute_rope_rows(tensor, self.num_heads)
        if module.endswith("self_attn.k_proj"):
            return permute_rope_rows(tensor, self.num_kv_heads)
        return tensor

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama3 RoPE: the per-frequency divisor llama.cpp reads from `rope_freqs.weight`; None otherwise.

        Llama 3.1 stretches low frequencies by `factor`, keeps high ones, and interpolates between the two
        wavelength bounds; llama.cpp divides each base frequency by the factor stored here.
        """
        if self.rope.get("rope_type") != "llama3":
            return None
        theta = float(self.rope.get("rope_theta", 10000.0))
        factor = float(self.rope.get("factor", 8.0))
        low_factor = float(self.rope.get("low_freq_factor", 1.0))
        high_factor = float(self.rope.get("high_freq_factor", 4.0))
        old_context = float(self.rope.get("original_max_position_embeddings", 8192))
        frequencies = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        divisors = []
        for frequency in frequencies.tolist():
            wavelength = 2 * math.pi / frequency
            if wavelength < old_context / high_factor:
                divisors.append(1.0)
            elif wavelength > old_context / low_factor:
                divisors.append(factor)
            else:
                smooth = (old_context / wavelength - low_factor) / (high_factor - low_factor)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        return torch.tensor(divisors, dtype=torch.float32)


def permute_rope_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder the rows of each head from halves [x.., y..] to interleaved pairs [x0, y0, x1, y1, ...].

    Works on a weight (out, in), a bias (out,) or a LoRA B (out, r): only the first dimension moves.
    """
    rows = tensor.shape[0]
    half = rows // num_heads // 2
    # (heads, 2, d/2, ...) -> (heads, d/2, 2, ...): the two halves of a head become adjacent pairs
    return tensor.reshape(num_heads, 2, half, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type") or rope.get("type") or "default"
    return rope


def _sliding_window(config: dict[str, Any], architecture: str) -> int | None:
    """Mistral's sliding window, where it is shorter than the context; None otherwise.

    transformers' Mistral lets each token attend to the last `sliding_window` tokens only; llama.cpp runs
    Mistral as `llama`, which attends to the whole context. The two agree exactly up to `sliding_window`
    tokens (a window as long as the sequence is no window), so the file declares that context (llama.cpp
    warns beyond it) instead of the longer one, where its outputs silently differ (Mistral 7B v0.1: 4096
    of 32768). transformers' Llama ignores the key, so it is read for Mistral only.
    """
    window = config.get("sliding_window")
    if architecture != "MistralForCausalLM" or not window:
        return None
    return int(window) if int(window) < int(config.get("max_position_embeddings", 2048)) else None


def layout_from_config(config: dict[str, Any], where: str) -> LlamaLayout:
    """Check that `config` (a config.json mapping) is a model llama.cpp's Llama graph runs, and read its shape.

    Raises:
        ExportError: another architecture, or a Llama variant the export does not handle (MLP biases,
            a RoPE scaling type llama.cpp's Llama graph does not have).
    """
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ExportError(
            f"{where}: architecture {architecture} cannot be exported to GGUF yet; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if config.get("mlp_bias"):
        raise ExportError(f"{where}: Llama with MLP biases (mlp_bias: true) cannot be exported to GGUF yet")
    rope = _rope_parameters(config)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ExportError(
            f"{where}: RoPE type {rope['rope_type']!r} cannot be exported to GGUF yet; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    num_heads = int(config["num_attention_heads"])
    return LlamaLayout(
        config=config,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
        rope=rope,
        sliding_window=_sliding_window(config, architecture),
    )


def read_layout(model_dir: Path) -> LlamaLayout:
    """`layout_from_config` of a model directory's config.json."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise ExportError(f"{model_dir} has no config.json; give a model directory written by save_pretrained")
    try:  # a config cut short or hand-edited was a JSONDecodeError traceback
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ExportError(f"{config_file} is not valid JSON ({exc}); re-save the model with save_pretrained") from None
    if not isinstance(config, dict):
        raise ExportError(f"{config_file} is not a JSON object; re-save the model with save_pretrained")
    return layout_from_config(config, str(model_dir))


def write_hyperparameters(writer: Any, layout: LlamaLayout) -> None:
    """The `llama.*` keys llama.cpp reads to build the graph: sizes, heads, RoPE, norm epsilon."""
    import gguf

    config = layout.config
    writer.add_context_length(layout.context_length)
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(layout.num_layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(layout.num_heads)
    writer.add_head_count_kv(layout.num_kv_heads)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_rope_dimension_count(layout.head_dim)
    writer.add_rope_freq_base(float(layout.rope["rope_theta"]))
    if layout.head_dim != int(config["hidden_size"]) // layout.num_heads:
        writer.add_key_length(layout.head_dim)
        writer.add_value_length(layout.head_dim)
    if layout.rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(layout.rope["factor"]))
