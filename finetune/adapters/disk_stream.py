"""Carrying out a `DiskOperation`: the target ledger's model written shard by shard into a staging directory.

Exact (the operation has a pristine base): every tensor comes from `PristineWeights` over the base's files,
and each touched one becomes round(W_base + Σ wᵢ·ΔWᵢ) over the target ledger, the formula in-memory
merges use (`arithmetic.merged_weight`), so the files equal a fresh merge bit for bit.

Inexact fallback (`inexact_weights`, no pristine base): each touched tensor becomes
round(W_model + Σ (w_new − w_old)·ΔW) in fp32, and the report gives the largest drift this can cause
against an exact merge (half an ulp of the stored value plus half an ulp of the result, per element).

Peak memory is one output tensor (each is written as it is computed: `model_dir.write_planned_shard`) plus
the adapters (fp32) plus one fp32 accumulator: a tensor's, or a fused expert tensor's one expert's slice
(where the files store one tensor per expert, only that expert's are read and split:
`ExpertLayout.read_expert`). Adapters
trained on a 4-bit/8-bit base are merged into the weights they were trained against: each linear weight
bitsandbytes would quantize goes through the same quantize → dequantize round trip
(`pristine.quantization_roundtrip`, on the operation's device: bitsandbytes quantizes on CUDA where the base
was quantized there), and the model is written in 16/32-bit. With tied input and output
embeddings, an update to either unties them (`finetune.adapters.tied`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from finetune.adapters.arithmetic import Term, half_ulp, merged_weight, module_terms
from finetune.adapters.disk_operation import DiskOperation
from finetune.adapters.expert_files import ExpertLayout
from finetune.adapters.experts import bind_experts
from finetune.adapters.fit import bind_layouts, check_fits
from finetune.adapters.ledger import Ledger
from finetune.adapters.lora import Adapter
from finetune.adapters.model_dir import (
    INDEX_NAME,
    PlannedTensor,
    after_shard_hook,
    copy_side_files,
    ensure_free,
    staging_dir,
    write_config,
    write_index,
    write_planned_shard,
)
from finetune.adapters.pristine import PristineWeights, quantization_roundtrip
from finetune.adapters.result import ArithmeticResult
from finetune.adapters.tensor_index import TensorIndex
from finetune.adapters.tied import TIE_KEY, stored_aliases
from finetune.adapters.tokenizer_files import (
    carries_tokenizer,
    check_vocabulary_files,
    copy_tokenizer,
    shared_tokenizer_dir,
)


def inexact_weights(source: Ledger, target: Ledger) -> dict[str, float]:
    """The weights to add to a merged model's own tensors to reach `target`: w_new − w_old, zeros dropped."""
    old, new = source.weights, target.weights
    differences = {name: new.get(name, 0.0) - old.get(name, 0.0) for name in set(old) | set(new)}
    return {name: weight for name, weight in differences.items() if weight != 0.0}


class _ShardWriter:
    """Computes the output tensors of one input file at a time (see the module docstring)."""

    def __init__(self, operation: DiskOperation, read_index: TensorIndex):
        self.exact = operation.pristine_dir is not None
        read_dir = operation.pristine_dir or operation.source_dir
        weights = (
            operation.target_ledger.weights
            if self.exact
            else inexact_weights(operation.source_ledger, operation.target_ledger)
        )
        architecture = _meta_model(read_dir)  # one per operation: tied names, quantizable weights, expert tensors
        operation.adapters = {
            name: bind_layouts(bind_experts(a, architecture), architecture) for name, a in operation.adapters.items()
        }
        self.terms = module_terms(weights, operation.adapters)
        self.terms_of_tensor = {terms[0][2].tensor_name(module): terms for module, terms in self.terms.items()}
        self.read_index = read_index
        self.source_index = read_index if read_dir == operation.source_dir else TensorIndex.of(operation.source_dir)
        self.aliases = stored_aliases(architecture, read_index)
        self.untied = _names_to_untie(self.aliases, self.terms)
        quantized = operation.quantization.method != "none"
        self.quantized_weights = _quantizable_weights(architecture) if quantized else set()
        roundtrip = quantization_roundtrip(self.quantized_weights, operation.quantization) if quantized else None
        self.pristine = PristineWeights(
            read_index, device=operation.base.device, verify=False, aliases=self.aliases, roundtrip=roundtrip,
            layout=ExpertLayout(architecture, read_index),
        )  # fmt: skip
        self._split: dict[str, torch.Tensor] = {}  # stored part -> its merged values, while its fused tensor is written
        self._started: set[str] = set()  # fused tensors merged expert by expert, at least one expert so far
        self.dtype = operation.base.dtype
        self.device = operation.base.device
        self.rewritten, self.max_drift_bound = 0, 0.0

    def check(self, adapters: dict[str, Adapter], where: Path) -> None:
        """Every adapter fits the weights read (shapes, tied names) and, exactly, the base copies peft saved."""
        for adapter in adapters.values():
            check_fits(adapter, self._stored_shape, base=str(where))
            for module in sorted(adapter.base_copies) if self.exact else []:
                stored = self.pristine.stored_name(module + ".weight")
                if stored is not None:
                    adapter.check_base_copy(module, self.read_index.read(stored))

    def _stored_shape(self, module: str) -> tuple[int, ...]:
        layout = self.pristine.layout
        for name in (module, module + ".weight"):  # a fused expert tensor, or a router's weight stored renamed
            if layout is not None and name in layout.fused:
                return layout.fused[name].shape
        stored = self.pristine.stored_name(module + ".weight") or self.pristine.stored_name(module)
        if stored is None:
            raise KeyError(module)
        return self.read_index[stored].shape

    def planned(self, file: Path) -> list[PlannedTensor]:
        """The output tensors of input file `file`: its tensors, and the tied partners an update unties."""
        planned = []
        for name in self.read_index.names_in(file):
            out_dtype, shape = self._out_dtype(name), tuple(self.read_index[name].shape)
            planned.append(PlannedTensor(name, out_dtype, shape))
            for tied_name in self.untied.get(name, []):  # the tied partner gets a tensor of its own
                planned.append(PlannedTensor(tied_name, out_dtype, shape))
        return planned

    def tensor(self, entry: PlannedTensor) -> torch.Tensor:
        """The output values of one planned tensor (computed as the shard is written)."""
        return self._output(entry.name, entry.dtype)

    def _out_dtype(self, name: str) -> torch.dtype:
        """The dtype written: as the source model stores it (or `--dtype`); non-float tensors unchanged."""
        header = self.source_index.get(name) or self.read_index[name]
        stored = header.torch_dtype or self.read_index[name].torch_dtype
        assert stored is not None, f"{name}: unknown safetensors dtype {header.dtype}"
        return (self.dtype or stored) if stored.is_floating_point else stored

    def _output(self, name: str, out_dtype: torch.dtype) -> torch.Tensor:
        layout = self.pristine.layout
        fused = layout.owner_of.get(name) if layout is not None else None
        if fused is not None and fused in self.terms_of_tensor:  # one expert's share of an updated fused tensor
            if name not in self._split:
                self._split.update(self._merged_parts(fused, name, out_dtype))
            return self._split.pop(name)
        base = self.pristine.get(name, out_dtype)
        terms: list[Term] = self.terms_of_tensor.get(name, [])
        if not terms:
            return base.to(out_dtype)
        result = merged_weight(base, terms, out_dtype, module=name.removesuffix(".weight"))
        self.rewritten += 1
        if not self.exact:
            self._widen_drift_bound(self._stored(name).to(result.device), result)
        return result

    def _widen_drift_bound(self, stored: torch.Tensor, result: torch.Tensor) -> None:
        """Inexact merges: the largest drift against an exact merge, half an ulp of each value per element."""
        self.max_drift_bound = max(self.max_drift_bound, (half_ulp(stored) + half_ulp(result)).max().item())

    def _merged_parts(self, fused: str, part: str, out_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The stored parts of updated fused tensor `fused` that are computed with `part`: those of its expert
        where each part lies in one expert's slice (one expert's slice held), else all of them."""
        layout = self.pristine.layout
        assert layout is not None
        terms = self.terms_of_tensor[fused]
        if terms[0][2].num_experts == 1 or not layout.experts_apart(fused):  # a router, or parts across experts
            return layout.split(fused, self._output(fused, out_dtype))
        expert = layout.expert_of(fused, part)
        read, device = self.read_index.read, self.device
        base = layout.read_expert(fused, expert, read, out_dtype, device)
        result = merged_weight(base, terms, out_dtype, module=fused, expert=expert)
        if fused not in self._started:
            self._started.add(fused)
            self.rewritten += 1
        if not self.exact:
            stored_dtype = self.read_index[part].torch_dtype or out_dtype
            self._widen_drift_bound(layout.read_expert(fused, expert, read, stored_dtype, device), result)
        return layout.split_expert(fused, expert, result)

    def _stored(self, name: str) -> torch.Tensor:
        """Tensor `name` as the read files store it (a fused expert tensor assembled in its parts' dtype)."""
        layout = self.pristine.layout
        if layout is None or name not in layout.fused:
            return self.read_index.read(name)
        dtype = self.read_index[layout.parts(name)[0]].torch_dtype
        assert dtype is not None
        return layout.read(name, self.read_index.read, dtype)


def write_target(operation: DiskOperation, out: str | Path, kind: str) -> ArithmeticResult:
    """Write the target ledger's model into `out`, shard by shard (floats in the operation's dtype, else as stored)."""
    started = time.perf_counter()
    out = ensure_free(out)
    read_dir = operation.pristine_dir or operation.source_dir
    read_index = TensorIndex.of(read_dir)
    writer = _ShardWriter(operation, read_index)
    writer.check(operation.adapters, read_dir)
    tokenizer = _tokenizer_to_pass_on(operation)  # checked before anything is written
    with staging_dir(out) as tmp:
        weight_map: dict[str, str] = {}
        total_bytes = 0
        for file in read_index.files:
            planned = writer.planned(file)
            total_bytes += sum(entry.nbytes for entry in planned)
            weight_map.update(write_planned_shard(tmp, file.name, planned, writer.tensor, operation.target_ledger))
            read_index.release(file)
            after_shard_hook()
        if len(read_index.files) > 1 or (read_dir / INDEX_NAME).is_file():
            write_index(tmp, weight_map, total_bytes)
        copy_side_files(operation.source_dir, tmp)
        if tokenizer is not None:
            copy_tokenizer(tokenizer, tmp)
        config = json.loads((operation.source_dir / "config.json").read_text())
        if writer.aliases:  # the base ties weights: the output does too, unless an update touches one of them
            config[TIE_KEY] = not writer.untied
        write_config(tmp, config, operation.target_ledger, writer.dtype or writer.source_index.single_dtype())
    notes = list(operation.notes)
    if writer.quantized_weights:
        notes.append(
            f"dequantized the {operation.target_ledger.base_quantization} base ({len(writer.quantized_weights)} linear "
            "weights) and wrote 16/32-bit weights"
        )
    return ArithmeticResult(
        kind, operation.target_ledger.weights, writer.rewritten, time.perf_counter() - started, notes, out,
        len(read_index.files), writer.exact, writer.max_drift_bound,
    )  # fmt: skip


def _tokenizer_to_pass_on(operation: DiskOperation) -> Path | None:
    """The output's tokenizer: its merged adapters' where they carry one (the tokenizer their runs trained with,
    `tokenizer_files`), if its vocabulary is the base's; else the pristine base's (an adapter taken out takes its
    tokenizer with it); else None, the source's as copied."""
    merged = [operation.adapters[n] for n in operation.target_ledger.entries if n in operation.adapters]
    source = shared_tokenizer_dir(merged, "the output")
    if source is not None:
        base_dir = next(
            (d for d in (operation.pristine_dir, operation.source_dir) if d is not None and carries_tokenizer(d)), None
        )
        if base_dir is not None:
            check_vocabulary_files(source, base_dir, "the output")
        return source
    if operation.pristine_dir is not None and carries_tokenizer(operation.pristine_dir):
        return operation.pristine_dir
    return None


def _names_to_untie(aliases: dict[str, str], terms: dict) -> dict[str, list[str]]:
    """stored name -> tied names to write beside it: those whose pair (either side) holds an update."""
    untie: dict[str, list[str]] = {}
    for tied_name, stored in sorted(aliases.items()):
        if {tied_name.removesuffix(".weight"), stored.removesuffix(".weight")} & set(terms):
            untie.setdefault(stored, []).append(tied_name)
    return untie


def _meta_model(model_dir: Path) -> PreTrainedModel:
    """The checkpoint's architecture on the meta device: its module tree, with no weights allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _quantizable_weights(architecture: PreTrainedModel) -> set[str]:
    """Names of the weights bitsandbytes quantizes on load: every nn.Linear except the output embeddings."""
    output = architecture.get_output_embeddings()
    return {
        f"{name}.weight"
        for name, m in architecture.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not output
    }
