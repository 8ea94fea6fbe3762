"""A LoRA adapter alone as a GGUF LoRA adapter, applied by llama.cpp at load time (`--lora FILE.gguf`).

llama.cpp adds scale · B·A to each weight with scale = `adapter.lora.alpha` / r, r read per tensor from
`lora_a`; the user's `--lora-scaled` multiplies that. One alpha serves the whole file, so modules whose
own scale differs (rsLoRA's alpha / sqrt(r), `rank_pattern`, `alpha_pattern`) get the ratio folded into
B; for a plain adapter B is written unchanged. Tensors are named after the base weight they update
(`blk.0.attn_q.weight.lora_a`, `.lora_b`), and B's rows of q/k projections are reordered like the base's
(`llama_layout`), so the file applies to a GGUF export of the same base.

Example:
    report = export_lora_gguf("adapters/legal", "legal-lora.gguf")
    # llama-cli -m base.gguf --lora legal-lora.gguf
"""

from __future__ import annotations

from pathlib import Path

from finetune.adapters.fit import check_fingerprint
from finetune.adapters.lora import Adapter, read_adapter
from finetune.adapters.resolved_base import resolve_model_dir
from finetune.adapters.tensor_index import TensorIndex
from finetune.errors import ExportError
from finetune.export.gguf_file import PlannedTensor, file_type, tensor_dtype, write_gguf
from finetune.export.gguf_model import ExportReport, check_dtype, fallback_notes
from finetune.export.llama_layout import GGUF_ARCH, SUPPORTED_ARCHITECTURES, LlamaLayout, read_layout
from finetune.fingerprint import fingerprint_model_dir


def _lora_tensors(adapter, layout: LlamaLayout, alpha: float, dtype: str) -> list[PlannedTensor]:
    """(lora_a, lora_b) per targeted module, B scaled so that alpha / r times B·A is the adapter's update."""
    plan = []
    for module, lora in sorted(adapter.modules.items()):
        if lora.fan_in_fan_out:
            raise ExportError(f"{adapter.path}: module {module} is fan_in_fan_out (Conv1D), not a Llama linear layer")
        if lora.embedding:
            raise ExportError(
                f"{adapter.path}: the adapter updates the input embeddings ({module}), which a llama.cpp LoRA file "
                "cannot carry here; merge the adapter (finetune adapters merge) and export the merged model instead"
            )
        hf_name = module + ".weight"
        gguf_name = layout.gguf_name(hf_name)
        if gguf_name is None:
            raise ExportError(
                f"{adapter.path}: the adapter updates {module}, which the base ties to its input embeddings; "
                "llama.cpp cannot apply it as a LoRA (merge the adapter and export the model instead)"
            )
        # 1 for a plain adapter: llama.cpp's alpha / r is the scale. llama.cpp reads alpha 0 as scale 1 (no
        # division by r), so a file with lora_alpha 0 (its modules' scales from alpha_pattern, or 0) takes B · scale.
        fold = lora.scale * lora.rank / alpha if alpha else lora.scale
        A = lora.A.contiguous()
        B = layout.to_llama_cpp(hf_name, lora.B * fold if fold != 1.0 else lora.B).contiguous()
        for suffix, tensor in (("lora_a", A), ("lora_b", B)):
            shape = tuple(tensor.shape)
            plan.append(PlannedTensor(f"{gguf_name}.{suffix}", shape, tensor_dtype(shape, dtype), tensor.numpy))
    return plan


def _check_base_shapes(adapter, base_dir: Path) -> None:
    """Every module the adapter updates is a weight of `base_dir` whose shape is B·A's (after `_lora_tensors`,
    which refuses embeddings, Conv1D and a tied head with their own reasons).

    The base gives the export only names and the q/k layout; given another base (`--base`), the file was
    written and llama.cpp refused it only at load ("incorrect shape ... maybe wrong base model?").
    """
    headers = TensorIndex.of(base_dir)
    for module, lora in sorted(adapter.modules.items()):
        expected = (int(lora.B.shape[0]), int(lora.A.shape[1]))
        header = headers.get(module + ".weight")
        found = "no such weight" if header is None else f"shape {tuple(header.shape)}"
        if header is None or tuple(header.shape) != expected:
            raise ExportError(
                f"{adapter.path}: module {module} updates a {expected} weight but the base {base_dir} has {found}; "
                "give the base the adapter was trained on (--base)"
            )


def _exportable(adapter_dir: str | Path) -> Adapter:
    """The adapter, unless llama.cpp cannot apply it: DoRA and the like, or updates of expert tensors."""
    adapter = read_adapter(adapter_dir)
    if adapter.unmergeable is not None:
        raise ExportError(
            f"{adapter_dir}: {adapter.unmergeable.split(';')[0]}; llama.cpp's LoRA takes B·A updates only"
        )
    if any(lora.num_experts > 1 for lora in adapter.modules.values()):
        raise ExportError(
            f"{adapter_dir}: the adapter updates a mixture of experts' expert tensors; GGUF export takes dense "
            f"{' and '.join(SUPPORTED_ARCHITECTURES)} bases only, as an adapter or merged, so serve it with "
            "`finetune serve` (or merge it with `finetune adapters merge` for transformers) instead"
        )
    return adapter


def export_lora_gguf(
    adapter_dir: str | Path, out: str | Path, *, dtype: str = "f32", base: str | None = None, force: bool = False
) -> ExportReport:
    """Export a peft LoRA adapter to a GGUF LoRA adapter for llama.cpp.

    Args:
        adapter_dir: the adapter directory (adapter_config.json + adapter_model.safetensors).
        out: the .gguf file to write (must not exist).
        dtype: encoding of A and B (f32 keeps the adapter exact).
        base: the base model directory, for its shape; default: the base the adapter records. One given is checked
            against the fingerprint the adapter records, as `adapters merge` checks it.
        force: export over a `base` of another fingerprint anyway.

    Raises:
        ExportError: the base is not a supported architecture; the adapter targets something llama.cpp
            cannot apply a LoRA to. `AdapterError` for adapters `read_adapter` refuses (DoRA, saved modules) and for
            a `base` of another fingerprint than the adapter's (without `force`).
    """
    import gguf

    check_dtype(dtype)
    adapter = _exportable(adapter_dir)
    base_ref = base or adapter.base_path
    if not base_ref:
        raise ExportError(f"{adapter_dir}: the adapter records no base model; pass --base MODEL_DIR")
    base_dir = resolve_model_dir(base_ref)  # weight files checked whole
    layout = read_layout(base_dir)
    alpha = float(adapter.config.get("lora_alpha", 8))
    tensors = _lora_tensors(adapter, layout, alpha, dtype)
    _check_base_shapes(adapter, base_dir)
    if base is not None:  # shapes alone pass a base of other heads, whose q/k rows the export then orders wrongly
        check_fingerprint(adapter, fingerprint_model_dir(base_dir), f"--base {base}", force=force)

    def add_metadata(writer) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        writer.add_name(adapter.name)
        writer.add_file_type(file_type(dtype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if adapter.base_fingerprint:
            writer.add_string("finetune.base_fingerprint", adapter.base_fingerprint)

    written = write_gguf(out, GGUF_ARCH, add_metadata, tensors)
    trained_on = adapter.trained_quantization
    notes = (f"base {base_ref}", *fallback_notes(tensors, dtype))
    if trained_on is not None and trained_on.method != "none":  # QLoRA: learned against the dequantized weights
        notes += (
            f"trained on a {trained_on.describe()} base: llama.cpp applies it to the base's GGUF as exported (from "
            "its 16/32-bit weights), not to the dequantized weights it learned against (`adapters merge` does)",
        )
    return ExportReport(written, "lora adapter", dtype, len(tensors), notes)
