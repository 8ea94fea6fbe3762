"""Combine several LoRA adapters into one whose update approximates (or equals) Σ wᵢ·ΔWᵢ.

LoRA on mixture-of-experts tensors combines by `cat` only (each expert's ranks concatenated).

- `cat`: concatenate ranks. Per module, A = [A₁; A₂; ...] (rows) and B = [c₁B₁, c₂B₂, ...] (columns)
  with cᵢ = wᵢ·scaleᵢ folded into B, and the combined adapter's own scale set to 1 (alpha = r per
  module, via rank_pattern/alpha_pattern). Then B·A = Σ wᵢ·ΔWᵢ exactly, up to fp32 rounding. Signed
  weights are fine (peft's `add_weighted_adapter(..., "linear")` is not: it combines A and B separately,
  peft issue #3004).
- `svd`: the exact sum ΔW = Σ wᵢ·ΔWᵢ per module, truncated to rank k by SVD (the best rank-k
  approximation in Frobenius norm).
- `ties`: on each wᵢ·ΔWᵢ, keep the `density` fraction of largest magnitudes, elect each element's sign by
  the sign of the sum, average the kept values that agree with it (Yadav et al. 2023), then rank k by SVD.
- `dare`: drop each element of wᵢ·ΔWᵢ with probability 1 − density, rescale survivors by 1/density
  (Yu et al. 2023), sum, then rank k by SVD.

Rank-reducing methods report the relative Frobenius error ‖ΔW_combined − ΔW_exact‖ / ‖ΔW_exact‖ over all
modules together, and the worst module; `cat` reports its (rounding-level) error too.

Example:
    report = combine_adapters(["adapters/legal", "adapters/med"], "adapters/legal-med", weights=[1, -0.5])
    print(report.summary())
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.adapters.experts import clean_name, matches_target
from finetune.adapters.lora import (
    CONFIG_NAME,
    SAFETENSORS_NAME,
    Adapter,
    LoraWeights,
    pattern_key,
    read_adapter,
    recorded_quantization,
)
from finetune.adapters.model_dir import staging_dir
from finetune.adapters.tokenizer_files import copy_tokenizer, shared_tokenizer_dir
from finetune.errors import AdapterError
from finetune.manifest import Manifest, library_versions, now_iso, write_manifest

METHODS = ("cat", "svd", "ties", "dare")


def parse_weights(text: str | None, count: int) -> list[float]:
    """ "1,-0.5" -> [1.0, -0.5]; None -> all ones."""
    if text is None:
        return [1.0] * count
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        raise AdapterError(f"--weights {text!r} is not a comma-separated list of numbers, e.g. 1,-0.5") from None
    if len(weights) != count:
        raise AdapterError(f"--weights has {len(weights)} values for {count} adapters; give one per adapter")
    if not all(math.isfinite(weight) for weight in weights):
        raise AdapterError(f"--weights {text!r}: every weight must be a finite number, e.g. 1,-0.5")
    return weights


@dataclass
class CombineReport:
    method: str
    out: Path
    relative_error: float
    worst_module: str
    worst_relative_error: float
    rank_by_module: dict[str, int]

    def summary(self) -> str:
        ranks = sorted(set(self.rank_by_module.values()))
        exactness = "exact up to fp32 rounding" if self.method == "cat" else "rank-reduced"
        return (
            f"combine ({self.method}, {exactness}): wrote {self.out} with rank {'/'.join(map(str, ranks))} over "
            f"{len(self.rank_by_module)} modules; relative Frobenius error vs the exact weighted sum "
            f"{self.relative_error:.3e} (worst module {self.worst_module}: {self.worst_relative_error:.3e})"
        )


def _low_rank(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (k, in), B (out, k)) with B·A the best rank-k approximation of `delta`."""
    U, S, Vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    k = min(rank, S.shape[0])
    root = S[:k].sqrt()  # split the singular values evenly so A and B have similar norms
    return (root[:, None] * Vh[:k]).to(torch.float32), (U[:, :k] * root).to(torch.float32)


def _ties(tasks: list[torch.Tensor], density: float) -> torch.Tensor:
    trimmed = []
    for task in tasks:
        keep = max(1, int(round(density * task.numel())))
        threshold = task.abs().flatten().kthvalue(task.numel() - keep + 1).values
        trimmed.append(torch.where(task.abs() >= threshold, task, torch.zeros_like(task)))
    stacked = torch.stack(trimmed)
    sign = torch.sign(stacked.sum(dim=0))
    agree = (torch.sign(stacked) == sign) & (stacked != 0)
    return (stacked * agree).sum(dim=0) / agree.sum(dim=0).clamp_min(1)


def _dare(tasks: list[torch.Tensor], density: float, generator: torch.Generator) -> torch.Tensor:
    total = torch.zeros_like(tasks[0])
    for task in tasks:
        mask = torch.rand(task.shape, generator=generator) < density
        total += task * mask / density
    return total


def _check_compatible(adapters: list[Adapter]) -> None:
    recorded_quantization(adapters)  # adapters of differently quantized bases: refused, naming them
    fingerprints = {a.base_fingerprint for a in adapters if a.base_fingerprint}
    if len(fingerprints) > 1:
        listing = ", ".join(f"{a.name}: {a.base_fingerprint}" for a in adapters)
        raise AdapterError(f"the adapters were trained on different bases ({listing}); combine adapters of one base")
    if len({bool(a.config.get("fan_in_fan_out")) for a in adapters}) > 1:
        raise AdapterError("the adapters disagree on fan_in_fan_out; combine adapters of one architecture")
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for adapter in adapters:
        for module, lora in sorted(adapter.modules.items()):
            first = shapes.setdefault(module, (adapter.name, lora.weight_shape))
            if first[1] != lora.weight_shape:
                raise AdapterError(
                    f"{module} is {first[1]} in {first[0]!r} but {lora.weight_shape} in {adapter.name!r}: different bases"
                )


def _check_finite(module: str, *tensors: torch.Tensor) -> None:
    """Refuse a combination past float32's range (weights of 1e38, dare's rescale by 1/density): it was written as an
    adapter holding Inf, exit 0, that every later command refused, or it stopped svd with a LinAlgError traceback."""
    if not all(bool(torch.isfinite(tensor).all()) for tensor in tensors):
        raise AdapterError(
            f"combining gives NaN/Inf in {module}: the weighted updates exceed float32's range; lower --weights "
            "(or raise --density); nothing was written"
        )


def _combine_module(
    module: str,
    parts: list[tuple[LoraWeights, float]],
    method: str,
    target_rank: int,
    density: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One module's combination: (exact weighted sum of the ΔW, A, B, the ΔW that A and B give)."""
    tasks = [lora.delta(w) for lora, w in parts]
    exact = torch.stack(tasks).sum(dim=0)
    _check_finite(module, exact)
    if parts[0][0].num_experts > 1:
        return exact, *_cat_experts(parts)
    if method == "cat":
        A = torch.cat([lora.A for lora, _ in parts], dim=0)
        B = torch.cat([lora.B * (w * lora.scale) for lora, w in parts], dim=1)
        combined = B @ A
        return exact, A, B, combined.T if parts[0][0].fan_in_fan_out else combined
    if method == "svd":
        merged = exact
    elif method == "ties":
        merged = _ties(tasks, density)
    else:
        merged = _dare(tasks, density, generator)
    _check_finite(module, merged)
    A, B = _low_rank(merged.T if parts[0][0].fan_in_fan_out else merged, target_rank)
    return exact, A, B, (B @ A).T if parts[0][0].fan_in_fan_out else B @ A


def _cat_experts(parts: list[tuple[LoraWeights, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cat` for LoRA on an expert tensor: each expert's ranks concatenated, in peft's interleaved layout
    (A rows expert-major, B columns rank-major; see `LoraWeights.num_experts`)."""
    experts = parts[0][0].num_experts
    A = torch.cat([lora.A.reshape(experts, -1, lora.A.shape[-1]) for lora, _ in parts], dim=1)  # (E, Σr, in)
    B = torch.cat([(lora.B * (w * lora.scale)).reshape(lora.B.shape[0], -1, experts) for lora, w in parts], dim=1)
    combined = LoraWeights(A.reshape(-1, A.shape[-1]), B.reshape(B.shape[0], -1), 1.0, num_experts=experts)
    return combined.A, combined.B, combined.delta()


def _check_experts(adapters: list[Adapter], method: str) -> None:
    """Expert LoRA combines by `cat` only, into one rank for every module (peft keys expert ranks by tensor name)."""
    if not any(w.num_experts > 1 for a in adapters for w in a.modules.values()):
        return
    if method != "cat":
        raise AdapterError(
            f"combine {method} is not supported for adapters with LoRA on expert tensors; use --method cat"
        )
    for adapter in adapters:
        patterns = [*(adapter.config.get("rank_pattern") or {}), *(adapter.config.get("alpha_pattern") or {})]
        parameters = {target.rpartition(".")[2] for target in adapter.config.get("target_parameters") or []}
        for key, lora in adapter.modules.items():
            if lora.num_experts == 1:
                continue
            names = [key, *(f"{clean_name(key)}.{parameter}" for parameter in sorted(parameters))]
            if any(pattern_key(patterns, name) != name for name in names):
                raise AdapterError(
                    f"adapter {adapter.name!r} ({adapter.path}) has a rank_pattern/alpha_pattern that may set the rank or "
                    "alpha of an expert tensor, which combine cannot tell apart without the base; merge the adapters "
                    "instead (finetune adapters merge)"
                )
    _check_expert_cat_layout(adapters)


def _check_expert_cat_layout(adapters: list[Adapter]) -> None:
    """peft's ParamWrapper takes one rank per adapter over the modules its config names: a concatenated expert
    adapter exists only where every input has one rank on the same modules."""
    for adapter in adapters:
        ranks = sorted({lora.rank for lora in adapter.modules.values()})
        if len(ranks) > 1:
            raise AdapterError(
                f"adapter {adapter.name!r} ({adapter.path}) has LoRA on expert tensors at ranks {ranks}, and combine "
                "cat needs one rank per adapter; merge the adapters instead (finetune adapters merge)"
            )
    first = adapters[0]
    for adapter in adapters[1:]:
        differ = sorted(set(first.modules) ^ set(adapter.modules))
        if differ:
            raise AdapterError(
                f"adapters {first.name!r} and {adapter.name!r} adapt different modules ({len(differ)}, e.g. "
                f"{differ[0]}), and combine cat of LoRA on expert tensors needs the same ones; merge the adapters "
                "instead (finetune adapters merge)"
            )


def combine_adapters(
    paths: list[str | Path],
    out: str | Path,
    *,
    weights: list[float] | None = None,
    method: str = "cat",
    rank: int | None = None,
    density: float = 0.5,
    seed: int = 0,
    allow_pickle: bool = False,
) -> CombineReport:
    """Write one adapter to `out` combining `paths` with `weights` (see the module docstring for methods)."""
    if method not in METHODS:
        raise AdapterError(f"combine method {method!r} is not one of {', '.join(METHODS)}")
    if not 0.0 < density <= 1.0:
        raise AdapterError(f"--density {density} must be in (0, 1]")
    weights = weights or [1.0] * len(paths)
    adapters = [read_adapter(path, allow_pickle=allow_pickle) for path in paths]
    if len({a.name for a in adapters}) != len(adapters):
        adapters = [
            read_adapter(path, f"a{i}-{a.name}"[:64], allow_pickle=allow_pickle)
            for i, (path, a) in enumerate(zip(paths, adapters))
        ]
    for adapter in adapters:
        adapter.check_mergeable()
    _check_compatible(adapters)
    _check_experts(adapters, method)
    target_rank = rank or max(max(a.ranks) for a in adapters)
    generator = torch.Generator().manual_seed(seed)

    tensors: dict[str, torch.Tensor] = {}
    rank_by_module: dict[str, int] = {}
    error_squared, norm_squared, worst = 0.0, 0.0, ("", 0.0)
    modules = sorted({m for a in adapters for m in a.modules})
    expert_modules: set[str] = set()  # peft's wrappers of expert tensors: targeted by target_parameters
    for module in modules:
        parts = [(a.modules[module], w) for a, w in zip(adapters, weights) if module in a.modules]
        exact, A, B, combined = _combine_module(module, parts, method, target_rank, density, generator)
        _check_finite(module, A, B)
        error = (combined - exact).norm().item()
        norm = exact.norm().item()
        error_squared, norm_squared = error_squared + error**2, norm_squared + norm**2
        if norm > 0 and error / norm >= worst[1]:
            worst = (module, error / norm)
        first = parts[0][0]
        combined_lora = LoraWeights(A, B, 1.0, first.fan_in_fan_out, first.embedding, num_experts=first.num_experts)
        tensors.update(combined_lora.peft_tensors(module))
        rank_by_module[module] = combined_lora.rank
        targets = [t for a in adapters if module in a.modules for t in a.config.get("target_parameters") or []]
        # expert tensors, and routers peft reaches as a raw parameter (`mlp.gate.weight`), stay target_parameters:
        # as a target module peft would refuse the router (not an nn.Linear)
        if first.num_experts > 1 or matches_target(module + ".weight", targets):
            expert_modules.add(module)

    config = _combined_config(adapters[0].config, rank_by_module, expert_modules)
    _write(out, config, tensors, adapters, weights, method)
    relative = math.sqrt(error_squared) / max(math.sqrt(norm_squared), 1e-30)
    return CombineReport(method, Path(out), relative, worst[0], worst[1], rank_by_module)


def _combined_config(template: dict, rank_by_module: dict[str, int], expert_modules: set[str]) -> dict:
    """A peft config whose scale is 1 for every module: alpha = r, per module through the patterns (expert
    tensors stay targeted by the template's `target_parameters`).

    `target_modules` names every combined module in full, so the template's own selection of layers
    (`exclude_modules`, `layers_to_transform`, `layers_pattern`) is dropped: kept, peft would skip the other
    adapters' modules it excludes when it loads the file (unmerged use would lose part of the sum, unsaid).
    """
    r = max(rank_by_module.values())
    pattern = {re.escape(m): k for m, k in rank_by_module.items() if k != r}
    config = dict(template)
    config.update(
        r=r,
        lora_alpha=r,
        use_rslora=False,
        rank_pattern=pattern,
        alpha_pattern=dict(pattern),
        target_modules=sorted(set(rank_by_module) - expert_modules),
        exclude_modules=None,
        layers_to_transform=None,
        layers_pattern=None,
        lora_dropout=0.0,
        init_lora_weights=True,
        inference_mode=True,
    )
    return config


def _quantization_recipe(adapters: list[Adapter]) -> dict | None:
    """The recipe part that says how the adapters' base was quantized (nf4/fp4, double quantization), which a
    manifest's base record alone does not: without it the combined adapter read as trained on nf4."""
    recorded = recorded_quantization(adapters)
    return {"model": recorded.as_record()} if recorded is not None and recorded.method != "none" else None


def _provenance(adapters: list[Adapter], weights: list[float]) -> list[dict]:
    """What `combined_from` records of each input, as a merge's ledger does: its name, its absolute path (a relative
    one named another directory once the user changed directory), its weight, and the sha256 of its weights file,
    by which a later reader can tell whether the adapter at that path is still the one combined."""
    return [
        {"name": a.name, "path": str(a.path.resolve()), "weight": w, "sha256": a.file_sha256}
        for a, w in zip(adapters, weights)
    ]


def _write(out, config: dict, tensors: dict, adapters: list[Adapter], weights: list[float], method: str) -> None:
    """The combined adapter, with a manifest when any input has one: the base record is the first manifest's (the
    inputs' fingerprints agree, `_check_compatible`), whatever the order; a first input without a manifest dropped
    the base's fingerprint and the record of the combination altogether."""
    from safetensors.torch import save_file

    with staging_dir(out) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / SAFETENSORS_NAME), metadata={"format": "pt"})
        tokenizer = shared_tokenizer_dir(adapters, f"the combined adapter {Path(out).name}")
        if tokenizer is not None:  # the chat template the inputs trained with goes on with their sum
            copy_tokenizer(tokenizer, tmp)
        manifest = next((a.manifest for a in adapters if a.manifest is not None), None)
        if manifest is not None:
            combined = Manifest(
                name=Path(out).name,
                base=manifest.base,
                versions=library_versions(),
                created=now_iso(),
                combined_from=_provenance(adapters, weights),
                combine_method=method,
                recipe=_quantization_recipe(adapters),
            )
            write_manifest(tmp, combined)
