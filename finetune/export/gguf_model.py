"""A merged (or base) Llama-family model directory as one GGUF file that llama.cpp, Ollama and LM Studio load.

What goes in: the `llama.*` hyperparameters, every weight under llama.cpp's name with q/k rows reordered
for its RoPE (`llama_layout`), the tokenizer with a pre-tokenizer name llama.cpp knows (`gguf_tokenizer`),
general metadata, and, for a checkpoint written by `finetune adapters merge`, the ledger of merged
adapters under `finetune.merged`. Weights are read one tensor at a time from the safetensors files.

Example:
    report = export_model_gguf("merged/legal", "legal.gguf", dtype="q8_0")
    report.summary()    # 'wrote legal.gguf: llama, 21 tensors (q8_0), 1.2 MB, tokenizer pre gpt-2'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from finetune.adapters.ledger import LEDGER_KEY
from finetune.adapters.resolved_base import resolve_model_dir
from finetune.adapters.tensor_index import TensorIndex
from finetune.errors import ExportError
from finetune.export.gguf_file import DTYPES, PlannedTensor, file_type, tensor_dtype, write_gguf
from finetune.export.gguf_tokenizer import read_tokenizer, write_tokenizer
from finetune.export.llama_layout import GGUF_ARCH, LlamaLayout, read_layout, write_hyperparameters

LEDGER_METADATA_KEY = "finetune.merged"
"""GGUF key holding the ledger of adapters merged into the exported weights (JSON), when there is one."""

RECOMPUTED_BUFFERS = (".rotary_emb.inv_freq",)
"""Suffixes of tensors some checkpoints hold that are no weights: RoPE's inverse frequencies, which transformers
computes from config.json (and ignores in the file) but versions before 4.31 saved. `gguf`'s name map places them
(`blk.N.attn_rot_embd`), and llama.cpp refuses a file with tensors its graph does not load ("wrong number of
tensors"), so they are left out, as llama.cpp's own converter leaves them out."""


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote, for the CLI's one line and for tests."""

    out: Path
    kind: str
    """`model` or `lora adapter`."""
    dtype: str
    num_tensors: int
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        size_mb = self.out.stat().st_size / 1e6
        return "; ".join(
            (f"wrote {self.out}: {self.kind}, {self.num_tensors} tensors ({self.dtype}), {size_mb:.1f} MB",)
            + self.notes
        )


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype} is not supported; choose one of {', '.join(DTYPES)}")
    return dtype


def fallback_notes(tensors: list[PlannedTensor], dtype: str) -> tuple[str, ...]:
    """The summary's note on 2-D tensors not written as `dtype` (q8_0 rows not a multiple of 32: f16), if any.

    A LoRA's B has rank-long rows, so at the usual ranks (8, 16) every B of a q8_0 adapter is f16.
    """
    fallbacks = sorted({t.name for t in tensors if t.dtype != dtype and len(t.shape) > 1})
    return (f"{len(fallbacks)} tensors with rows not a multiple of 32 written as f16",) if fallbacks else ()


def _block_order(name: str) -> tuple[int, str]:
    """Sort key: non-block tensors first, then block by block (numerically), names within."""
    parts = name.split(".")
    return (int(parts[1]) + 1 if parts[0] == "blk" else 0, name)


def _loader(path: Path, hf_name: str, layout: LlamaLayout):
    def load() -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            tensor = handle.get_tensor(hf_name).float()
        return layout.to_llama_cpp(hf_name, tensor).numpy()

    return load


def plan_model_tensors(model_dir: Path, layout: LlamaLayout, dtype: str) -> list[PlannedTensor]:
    """Every weight of `model_dir` (plus llama3 RoPE factors) as GGUF tensors, in block order."""
    headers = TensorIndex.of(model_dir)
    if not headers:
        raise ExportError(f"{model_dir} holds no *.safetensors weights; re-save it with save_pretrained")
    plan = []
    for hf_name, (path, _, shape) in headers.items():
        if hf_name.endswith(RECOMPUTED_BUFFERS):
            continue
        gguf_name = layout.gguf_name(hf_name)
        if gguf_name is not None:
            plan.append(PlannedTensor(gguf_name, shape, tensor_dtype(shape, dtype), _loader(path, hf_name, layout)))
    factors = layout.rope_freq_factors()
    if factors is not None:
        plan.append(PlannedTensor("rope_freqs.weight", tuple(factors.shape), "f32", factors.numpy))
    return sorted(plan, key=lambda tensor: _block_order(tensor.name))


def export_model_gguf(
    model: str | Path, out: str | Path, *, dtype: str = "f16", name: str | None = None
) -> ExportReport:
    """Export a Llama-family model directory (a base, or a checkpoint with adapters merged) to a GGUF file.

    Args:
        model: a model directory, `embedded:<name>`, or a hub id in the local cache.
        out: the .gguf file to write (must not exist).
        dtype: encoding of the 2-D weights: f32, f16, bf16 or q8_0.
        name: `general.name`; default: the directory name.

    Raises:
        ExportError: unsupported architecture, tokenizer or dtype; quantized checkpoints; `out` exists.
    """
    check_dtype(dtype)
    model_dir = resolve_model_dir(str(model))  # weight files checked whole
    layout = read_layout(model_dir)
    if layout.config.get("quantization_config"):
        raise ExportError(
            f"{model_dir} is a bitsandbytes-quantized checkpoint; export the 16/32-bit model (merge writes one)"
        )
    tokenizer = read_tokenizer(model_dir, int(layout.config["vocab_size"]))
    tensors = plan_model_tensors(model_dir, layout, dtype)
    ledger = layout.config.get(LEDGER_KEY)

    def add_metadata(writer) -> None:
        import gguf

        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or model_dir.resolve().name)
        writer.add_file_type(file_type(dtype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_hyperparameters(writer, layout)
        write_tokenizer(writer, tokenizer)
        if ledger:
            writer.add_string(LEDGER_METADATA_KEY, json.dumps(ledger, sort_keys=True))

    written = write_gguf(out, GGUF_ARCH, add_metadata, tensors)
    notes = fallback_notes(tensors, dtype)
    if layout.sliding_window:
        notes += (
            f"context length {layout.context_length}: the sliding window, which llama.cpp's llama graph does not "
            "have (beyond it llama.cpp attends to every token, transformers to the last "
            f"{layout.sliding_window})",
        )
    notes += (f"tokenizer pre-tokenizer {tokenizer.pre_tokenizer}",)
    return ExportReport(written, "model", dtype, len(tensors), notes)
