"""`combine_adapters`, checked on the adapter it WRITES: every module's ΔW is read back from the file
(`read_adapter`) and compared with a reference recomputed here in float64 from the inputs' A and B with
each method's definition. `CombineReport`'s numbers are only compared with that recomputation.

- cat: the written ΔW is the exact weighted sum Σ wᵢ·ΔWᵢ; peft and `load_model` read it so too.
- svd: at the combined rank it is exact; below, it is the best rank-k approximation (Eckart–Young), and
  the reported relative Frobenius error is the one recomputed from the file.
- ties, dare: at full rank the written ΔW is the sparsified target itself (ties recomputed from its
  definition; dare shown to be a drop-and-rescale of each task); at rank k, its rank-k projection.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import ROUNDED_ULPS, assert_within_ulps, make_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

import finetune
from finetune.adapters.combine import CombineReport, combine_adapters
from finetune.adapters.lora import Adapter, LoraWeights, read_adapter

WEIGHTS = [1.0, -0.5]
FULL_RANK = 64  # the smallest dimension of every targeted weight of the tiny base: no truncation at all
FACTORS_ULPS = 16  # ΔW from A and B each rounded to float32 once, summed over the rank: ulps of its largest entry
RELATIVE_RESOLUTION = 16 * torch.finfo(torch.float32).eps  # a relative error figure from float32 norms


def delta64(lora: LoraWeights, weight: float = 1.0) -> torch.Tensor:
    """weight · scale · B·A in float64, shaped like the base weight (independent of `LoraWeights.delta`'s fp32)."""
    update = (weight * lora.scale) * (lora.B.double() @ lora.A.double())
    return update.T if lora.fan_in_fan_out else update


def task_deltas(paths: list[Path], weights: list[float]) -> dict[str, list[torch.Tensor]]:
    """module -> [wᵢ·ΔWᵢ for each input adapter that targets it], in input order, float64."""
    adapters = [read_adapter(path) for path in paths]
    modules = sorted({module for adapter in adapters for module in adapter.modules})
    return {
        module: [delta64(a.modules[module], w) for a, w in zip(adapters, weights) if module in a.modules]
        for module in modules
    }


def written_deltas(out: Path) -> tuple[Adapter, dict[str, torch.Tensor]]:
    """The adapter combine wrote, and every module's ΔW read back from it (float64)."""
    written = read_adapter(out)
    return written, {module: delta64(lora) for module, lora in written.modules.items()}


def rank_k(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """The best rank-k approximation of `matrix` (truncated SVD, float64)."""
    U, S, Vh = torch.linalg.svd(matrix, full_matrices=False)
    return (U[:, :k] * S[:k]) @ Vh[:k]


def assert_report_matches(report: CombineReport, written: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]):
    """The report's errors are the ones recomputed from the written file against the exact weighted sum
    (relative 1e-4: the report's norms are float32 sums over a matrix, ours float64)."""
    errors = {m: (written[m] - exact[m]).norm().item() for m in exact}
    norms = {m: exact[m].norm().item() for m in exact}
    relative = math.sqrt(sum(e**2 for e in errors.values())) / math.sqrt(sum(n**2 for n in norms.values()))
    assert report.relative_error == pytest.approx(relative, rel=1e-4, abs=RELATIVE_RESOLUTION)
    worst = max(exact, key=lambda m: errors[m] / norms[m])
    assert report.worst_relative_error == pytest.approx(errors[worst] / norms[worst], rel=1e-4, abs=RELATIVE_RESOLUTION)
    if report.worst_relative_error > 1e-3:  # below that, which module is worst is rounding noise
        assert report.worst_module == worst


def combine(paths, out, **options) -> tuple[CombineReport, dict[str, torch.Tensor]]:
    report = combine_adapters(paths, out, **options)
    written, deltas = written_deltas(out)
    assert set(report.rank_by_module) == set(written.modules)
    assert report.rank_by_module == {m: lora.rank for m, lora in written.modules.items()}
    return report, deltas


@pytest.mark.parametrize("weights", [WEIGHTS, [0.3, 2.0, -1.0]])
def test_cat_writes_the_exact_weighted_sum(tmp_path, tiny_base_dir, adapter_dirs, weights):
    names = ["legal", "med", "code"][: len(weights)]
    paths = [adapter_dirs[n] for n in names]
    tasks = task_deltas(paths, weights)
    report, written = combine(paths, tmp_path / "combined", weights=weights, method="cat")
    assert set(written) == set(tasks)
    exact = {module: sum(parts) for module, parts in tasks.items()}
    for module in tasks:
        assert_within_ulps(written[module], exact[module], FACTORS_ULPS, what=module)
    ranks = {m: sum(read_adapter(p).modules[m].rank for p in paths if m in read_adapter(p).modules) for m in tasks}
    assert report.rank_by_module == ranks  # cat concatenates ranks, it never truncates
    assert_report_matches(report, written, exact)

    # peft reads the written file the same way (rank_pattern/alpha_pattern of mixed ranks included) ...
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(tmp_path / "combined")
    )
    for module in tasks:
        delta = peft_model.base_model.model.get_submodule(module).get_delta_weight("default")
        assert_within_ulps(delta.double(), exact[module], FACTORS_ULPS, what=module)
    # ... and merging it with load_model equals merging its parts with their weights
    m = finetune.load_model(
        str(tiny_base_dir), {"combined": str(tmp_path / "combined"), **{n: str(adapter_dirs[n]) for n in names}}
    )
    m.merge("combined")
    combined = {k: v.clone() for k, v in m.model.state_dict().items()}
    m.subtract("combined")
    for name, weight in zip(names, weights):
        m.merge(name, weight)
    for key, tensor in m.model.state_dict().items():
        assert_within_ulps(combined[key], tensor, ROUNDED_ULPS, what=key)  # W + Σ w·ΔW against one merge at a time


def test_peft_loads_every_combined_module_when_the_first_adapter_excluded_some(tmp_path, tiny_base_dir, adapter_dirs):
    """The first adapter's `exclude_modules` selected its own layers; in the combined config peft would skip
    the other adapter's LoRA on them, and unmerged use (generate, eval, serve) would lose that part of the sum."""
    excluding = make_adapter(
        tiny_base_dir, tmp_path / "excluding", seed=5, exclude_modules=["model.layers.0.self_attn.q_proj"]
    )
    paths = [excluding, adapter_dirs["legal"]]  # legal has LoRA on layer 0's q_proj
    tasks = task_deltas(paths, WEIGHTS)
    combine(paths, tmp_path / "combined", weights=WEIGHTS, method="cat")
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_base_dir), str(tmp_path / "combined")
    )
    for module, parts in tasks.items():
        layer = peft_model.base_model.model.get_submodule(module)
        assert hasattr(layer, "get_delta_weight"), f"peft put no LoRA on {module}"
        assert_within_ulps(layer.get_delta_weight("default").double(), sum(parts), FACTORS_ULPS, what=module)


def test_svd_at_the_combined_rank_is_exact(tmp_path, adapter_dirs):
    paths = [adapter_dirs["legal"], adapter_dirs["med"]]  # q_proj carries rank 4 + 8 = 12
    tasks = task_deltas(paths, WEIGHTS)
    report, written = combine(paths, tmp_path / "svd", weights=WEIGHTS, method="svd", rank=12)
    exact = {module: sum(parts) for module, parts in tasks.items()}
    for module in tasks:
        assert_within_ulps(written[module], exact[module], FACTORS_ULPS, what=module)
    assert report.rank_by_module["model.layers.0.self_attn.q_proj"] == 12
    assert_report_matches(report, written, exact)


def test_svd_below_the_combined_rank_is_the_best_rank_k_approximation(tmp_path, adapter_dirs):
    paths = [adapter_dirs["legal"], adapter_dirs["med"]]
    tasks = task_deltas(paths, WEIGHTS)
    report, written = combine(paths, tmp_path / "svd2", weights=WEIGHTS, method="svd", rank=2)
    assert set(report.rank_by_module.values()) == {2}
    exact = {module: sum(parts) for module, parts in tasks.items()}
    for module in tasks:
        singular_values = torch.linalg.svdvals(exact[module])
        eckart_young = singular_values[2:].norm().item()  # no rank-2 matrix is closer than this
        assert eckart_young > 0.1 * singular_values[0]  # the truncation really loses something here
        error = (written[module] - exact[module]).norm().item()
        assert error == pytest.approx(eckart_young, rel=1e-5), module  # float64, from float32 factors
        assert_within_ulps(written[module], rank_k(exact[module], 2), FACTORS_ULPS, what=module)
    assert_report_matches(report, written, exact)
    assert 0.1 < report.relative_error < 1


def ties_target(tasks: list[torch.Tensor], density: float) -> torch.Tensor:
    """TIES-merging (Yadav et al. 2023) by its definition: trim each task to its top `density` fraction by
    magnitude, elect each element's sign as the sign of the trimmed sum, average the kept values that agree."""
    trimmed = []
    for task in tasks:
        keep = round(density * task.numel())
        mask = torch.zeros(task.numel(), dtype=torch.bool)
        mask[task.abs().flatten().topk(keep).indices] = True
        trimmed.append(task * mask.view(task.shape))
    elected = torch.sign(sum(trimmed))
    merged, count = torch.zeros_like(tasks[0]), torch.zeros_like(tasks[0])
    for task in trimmed:
        agrees = (torch.sign(task) == elected) & (task != 0)
        merged += torch.where(agrees, task, 0.0)
        count += agrees
    return merged / count.clamp_min(1)


@pytest.mark.parametrize("density", [0.3, 0.5])
def test_ties_writes_the_trimmed_sign_elected_mean_and_its_rank_k_projection(tmp_path, adapter_dirs, density):
    paths = [adapter_dirs["legal"], adapter_dirs["med"], adapter_dirs["code"]]
    weights = [1.0, -0.5, 0.8]
    tasks = task_deltas(paths, weights)
    targets = {module: ties_target(parts, density) for module, parts in tasks.items()}
    exact = {module: sum(parts) for module, parts in tasks.items()}
    for rank in (FULL_RANK, 2):
        report, written = combine(
            paths, tmp_path / f"ties{rank}", weights=weights, method="ties", rank=rank, density=density
        )
        for module, target in targets.items():
            assert_within_ulps(written[module], rank_k(target, rank), FACTORS_ULPS, what=f"{module} rank {rank}")
        assert_report_matches(report, written, exact)
    # the target is not the plain sum: trimming and sign election changed it
    assert all((targets[m] - exact[m]).norm() > 0.1 * exact[m].norm() for m in targets)


def test_dare_drops_and_rescales_each_task_reproducibly_by_seed(tmp_path, adapter_dirs):
    paths = [adapter_dirs["legal"], adapter_dirs["med"]]
    density = 0.5
    tasks = task_deltas(paths, WEIGHTS)
    exact = {module: sum(parts) for module, parts in tasks.items()}
    report, full = combine(
        paths, tmp_path / "full", weights=WEIGHTS, method="dare", rank=FULL_RANK, density=density, seed=7
    )
    assert_report_matches(report, full, exact)
    for module, parts in tasks.items():
        # Each element of the target is Σ over a subset S of the tasks of τᵢ/density (every task dropped or
        # kept whole at that element): find the subset nearest to the written value, and how far it is.
        candidates = torch.stack(
            [
                sum((p * bit for p, bit in zip(parts, bits)), torch.zeros_like(parts[0])) / density
                for bits in _subsets(len(parts))
            ]
        )  # (2^n, out, in)
        distance, chosen = (candidates - full[module]).abs().min(dim=0)
        scale = max(p.abs().max().item() for p in parts) / density
        assert distance.max().item() < 1e-5 * scale, module
        for i in range(len(parts)):  # each task kept at about `density` of its elements
            kept = torch.tensor([bits[i] for bits in _subsets(len(parts))])[chosen]
            assert abs(kept.float().mean().item() - density) < 0.05, module

    # the seed decides the masks, not the rank: rank 2 with the same seed is the projection of that target
    _, reduced = combine(paths, tmp_path / "reduced", weights=WEIGHTS, method="dare", rank=2, density=density, seed=7)
    for module in tasks:
        assert_within_ulps(reduced[module], rank_k(full[module], 2), FACTORS_ULPS, what=module)
    # the same seed writes the same file; another seed other masks
    combine_adapters(paths, tmp_path / "again", weights=WEIGHTS, method="dare", rank=FULL_RANK, density=density, seed=7)
    saved = "adapter_model.safetensors"
    assert (tmp_path / "again" / saved).read_bytes() == (tmp_path / "full" / saved).read_bytes()
    _, other = combine(
        paths, tmp_path / "other", weights=WEIGHTS, method="dare", rank=FULL_RANK, density=density, seed=8
    )
    assert all((other[m] - full[m]).norm() > 0.1 * exact[m].norm() for m in tasks)


def _subsets(count: int) -> list[tuple[int, ...]]:
    """Every 0/1 choice over `count` tasks: (0, 0), (0, 1), (1, 0), (1, 1) for two."""
    return [tuple((index >> bit) & 1 for bit in range(count)) for index in range(2**count)]


def test_a_combined_adapter_keeps_the_4bit_settings_its_adapters_were_trained_with(tmp_path, tiny_base_dir):
    """fp4 and double quantization live in the manifest's recipe, not in its base record: the combined adapter
    kept only the base record and read back as trained on nf4, so its merge dequantized the base another way."""
    from helpers import make_adapter

    from finetune.manifest import read_manifest, write_manifest

    adapters = [make_adapter(tiny_base_dir, tmp_path / name, seed=seed, targets=("q_proj",), quantization="4bit")
                for name, seed in (("one", 1), ("two", 2))]  # fmt: skip
    for path in adapters:  # as a run on an fp4 base without double quantization records it
        manifest = read_manifest(path)
        recipe = {"model": {"quantization": "4bit", "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False}}
        write_manifest(path, manifest.model_copy(update={"recipe": recipe}))
    combine_adapters(adapters, tmp_path / "both", weights=[1.0, 0.5])
    recorded = read_adapter(tmp_path / "both").trained_quantization
    assert (recorded.method, recorded.quant_type, recorded.double_quant) == ("4bit", "fp4", False)


def test_the_manifest_records_the_base_and_every_input_whatever_their_order(tmp_path, tiny_base_dir, monkeypatch):
    """A first input without a manifest (a plain peft adapter) made combine write none, so the combined adapter lost
    the base fingerprint its other inputs carried (merging it elsewhere warned instead of refusing); the inputs were
    recorded by the path as typed, relative to a directory the reader may not be in, and without their sha256."""
    import hashlib

    from finetune.manifest import read_manifest

    monkeypatch.chdir(tmp_path)
    make_adapter(tiny_base_dir, tmp_path / "plain", seed=4, targets=("q_proj",), manifest=False)
    make_adapter(tiny_base_dir, tmp_path / "recorded", seed=5, targets=("v_proj",))
    expected_base = read_manifest(tmp_path / "recorded").base
    for order in (["plain", "recorded"], ["recorded", "plain"]):
        out = tmp_path / f"mix-{order[0]}"
        combine_adapters(order, out, weights=[1.0, -0.5])
        manifest = read_manifest(out)
        assert manifest is not None and manifest.base == expected_base
        recorded = manifest.model_extra["combined_from"]
        assert [entry["path"] for entry in recorded] == [str(tmp_path / name) for name in order]
        assert [entry["weight"] for entry in recorded] == [1.0, -0.5]
        sha = [
            hashlib.sha256((tmp_path / name / "adapter_model.safetensors").read_bytes()).hexdigest() for name in order
        ]
        assert [entry["sha256"] for entry in recorded] == sha


@pytest.mark.parametrize(("method", "weights", "density"), [("cat", [3e38, 1.0], 0.5), ("svd", [3e38, 1.0], 0.5),
                                                             ("dare", [1e36, 1.0], 1e-3)])  # fmt: skip
def test_a_combination_past_float32s_range_is_refused_and_nothing_written(
    tmp_path, adapter_dirs, method, weights, density
):
    """cat wrote an adapter holding Inf (exit 0, "relative error nan"), which every later command refused; svd and
    dare (1/density rescale) stopped on torch's LinAlgError. README: NaN/Inf updates are refused before writing."""
    from finetune.errors import AdapterError

    paths = [adapter_dirs["legal"], adapter_dirs["med"]]
    with pytest.raises(AdapterError, match="NaN/Inf in model.layers"):
        combine_adapters(paths, tmp_path / "mix", weights=weights, method=method, density=density, seed=1)
    assert list(tmp_path.iterdir()) == []
