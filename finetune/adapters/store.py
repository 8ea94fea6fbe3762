"""The adapter store: list the adapters in a directory and describe one adapter or merged model.

Listing reads only `adapter_config.json`, `manifest.json`, file sizes and the weights file's header (the names
of the tensors, never their data), so it stays instant for a store of large adapters.

`describe_json` is `describe` for scripts (`info --json`): the same figures, as numbers, lists and nulls.

Example:
    print(format_table(list_store("adapters")))
    print(describe(resolve_adapter_path("legal", "adapters")))
    describe_json("merged/legal")["merged"][0]["weight"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from finetune import strict_json
from finetune.adapters.experts import clean_name, matches_target
from finetune.adapters.ledger import read_ledger
from finetune.adapters.lora import (
    CONFIG_NAME,
    PICKLE_NAME,
    SAFETENSORS_NAME,
    check_lora_type,
    lora_module,
    nested_adapters_hint,
    read_adapter_config,
)
from finetune.adapters.resolved_base import resolve_model_dir
from finetune.adapters.tensor_index import TensorIndex
from finetune.atomic import SET_ASIDE_MARK, STAGING_MARK
from finetune.errors import AdapterError
from finetune.manifest import MANIFEST_NAME, Manifest, read_manifest
from finetune.tensorfile import check_safetensors

_SHOWN_METRICS = 3


@dataclass(frozen=True)
class AdapterSummary:
    name: str
    path: Path
    base: str
    rank: str
    targets: str
    size_bytes: int
    metrics: str
    ranks: tuple[int, ...] = ()
    """The ranks as numbers (several with a rank_pattern), for `--json`; `rank` is the table's text."""
    metric_values: dict = field(default_factory=dict)
    """The manifest's metrics as numbers, for `--json`; `metrics` is the table's text."""
    problem: str | None = None
    """What is wrong with an adapter that cannot be read (its row shows it in place of the metrics)."""


def _config(adapter_dir: Path) -> dict:
    """The adapter's config, refused (one line, a problem row in the listing) when it is not LoRA's: an IA3 or LoHa
    adapter was described as a LoRA of rank "?" and alpha None, a prefix-tuning one as having no target_modules."""
    config = read_adapter_config(adapter_dir / CONFIG_NAME)
    check_lora_type(adapter_dir, config)
    return config


def _rank(config: dict) -> str:
    """The ranks smallest first, as numbers ("2/6/12"; sorted as text they read "12/2/6", and `--json` kept it)."""
    ranks = {config.get("r", "?"), *(config.get("rank_pattern") or {}).values()}
    return "/".join(str(r) for r in sorted(ranks, key=lambda r: (isinstance(r, str), 0 if isinstance(r, str) else r)))


def _targets(config: dict, adapter_dir: Path, weights: Path) -> str:
    """The linear layers' names, then the raw parameters (a mixture of experts' expert tensors, routers) if any.

    The layers are those the weights file holds LoRA for, where it is safetensors: peft's `target_modules` says
    what was asked, not what was adapted. With LoRA on the head or embeddings (`train_lm_head`) it is a regex, which
    was listed as the targets, and it keeps names `exclude_modules` took out (`down_proj` was listed for an adapter
    without any). A pickle file's names cannot be read without loading it: there, `target_modules` as written.
    """
    targets = config.get("target_modules")
    parameters = config.get("target_parameters") or []
    if not targets and not parameters:
        raise AdapterError(
            f"{adapter_dir / CONFIG_NAME} has no target_modules, so it adapts nothing; re-save the adapter with peft"
        )
    modules = _adapted_layers(weights, parameters)
    if modules is None:
        modules = [targets] if isinstance(targets, str) else sorted({t.rsplit(".", 1)[-1] for t in targets or []})
    return ",".join([*modules, *sorted({".".join(p.split(".")[-2:]) for p in parameters})])


def _adapted_layers(weights: Path, parameters: list[str]) -> list[str] | None:
    """The last name parts of the layers a safetensors weights file holds LoRA A/B for, from its header (peft's
    wrappers of `parameters` left out: those are listed as parameters); None for a pickle file."""
    if weights.name != SAFETENSORS_NAME:
        return None
    with safe_open(str(weights), "pt") as handle:
        keys = list(handle.keys())
    names = set()
    for module in (clean_name(m) for m in map(lora_module, keys) if m is not None):
        if not any(matches_target(f"{module}.{t.rpartition('.')[2]}", [t]) for t in parameters):
            names.add(module.rsplit(".", 1)[-1])
    return sorted(names)


def _weights_file(adapter_dir: Path) -> Path | None:
    """The adapter's weights file; a safetensors file must be whole (header and size agree)."""
    if (adapter_dir / SAFETENSORS_NAME).is_file():
        check_safetensors(adapter_dir / SAFETENSORS_NAME, AdapterError, "re-save or re-copy the adapter")
        return adapter_dir / SAFETENSORS_NAME
    return adapter_dir / PICKLE_NAME if (adapter_dir / PICKLE_NAME).is_file() else None


# What a reader of the store wants first: held-out quality, then how much training it took. A GRPO adapter's
# quality is its sampled reward: its evaluation loss and perplexity are of completions it wrote itself.
# A run that starts from another adapter names its figures before training `start_...`, not `base_...`.
_PREFERRED_METRICS = ("eval_ppl", "base_eval_ppl", "start_eval_ppl", "eval_loss", "step")
_PREFERRED_REWARD_METRICS = ("eval_reward", "base_eval_reward", "start_eval_reward", "step")
_NOT_HELD_OUT = ("eval_ppl", "base_eval_ppl", "start_eval_ppl", "eval_loss", "base_eval_loss", "start_eval_loss")


def _format_metrics(metrics: dict) -> str:
    shown = []
    preferred = _PREFERRED_REWARD_METRICS if "eval_reward" in metrics else _PREFERRED_METRICS
    rest = [k for k in metrics if k not in preferred and not ("eval_reward" in metrics and k in _NOT_HELD_OUT)]
    ordered = [k for k in preferred if k in metrics] + rest
    for key, value in [(k, metrics[k]) for k in ordered][:_SHOWN_METRICS]:
        shown.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(shown)


def summarize(adapter_dir: Path) -> AdapterSummary:
    config = _config(adapter_dir)
    rank = _rank(config)
    manifest = read_manifest(adapter_dir)
    weights = _weights_file(adapter_dir)
    if weights is None:  # listed as whole (0 B), it failed only when used
        raise AdapterError(
            f"{adapter_dir} has {CONFIG_NAME} but no {SAFETENSORS_NAME}: its weights are missing; re-copy or re-save it"
        )
    base = manifest.base.id if manifest is not None else (config.get("base_model_name_or_path") or "?")
    return AdapterSummary(
        name=manifest.name if manifest is not None else adapter_dir.name,
        path=adapter_dir,
        base=base,
        rank=rank,
        targets=_targets(config, adapter_dir, weights),
        size_bytes=weights.stat().st_size,
        metrics=_format_metrics(manifest.metrics) if manifest is not None else "",
        ranks=tuple(int(r) for r in rank.split("/") if r.isdigit()),
        metric_values=dict(manifest.metrics) if manifest is not None else {},
    )


def list_store(store_dir: str | Path) -> list[AdapterSummary]:
    """Every adapter directory directly under `store_dir`, sorted by name."""
    store_dir = Path(store_dir)
    if not store_dir.is_dir():
        raise AdapterError(f"no adapter store at {store_dir}; train an adapter first or pass the store directory")
    return [
        _summary_or_problem(p)
        for p in sorted(store_dir.iterdir())
        if (p / CONFIG_NAME).is_file() and not _in_writing(p)
    ]


def _in_writing(path: Path) -> bool:
    """A hidden sibling a writer builds an adapter in, or sets an old one aside in (`finetune.atomic`): not an
    adapter (a killed writer leaves one behind, the next write of that name deletes it)."""
    return path.name.startswith(".") and (STAGING_MARK in path.name or SET_ASIDE_MARK in path.name)


def _summary_or_problem(adapter_dir: Path) -> AdapterSummary:
    """A broken adapter is one row saying what is wrong with it, not an error hiding the rest of the store."""
    try:
        return summarize(adapter_dir)
    except AdapterError as exc:
        problem = f"unreadable: {exc}"
        return AdapterSummary(adapter_dir.name, adapter_dir, "?", "?", "?", 0, problem, problem=problem)


def as_json(rows: list[AdapterSummary]) -> str:
    """`finetune adapters list --json`: one object per adapter, the table's columns as numbers and lists (ranks,
    targets, size in bytes, the manifest's metrics), and `problem` saying what is wrong with an unreadable one."""
    return strict_json.dumps(
        [{"name": r.name, "path": str(r.path), "base": r.base, "ranks": list(r.ranks),
          "targets": r.targets.split(",") if r.targets != "?" else [], "size_bytes": r.size_bytes,
          "metrics": r.metric_values, "problem": r.problem}
         for r in rows],
        indent=2,
    )  # fmt: skip


def _size(size_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size_bytes < 1024 or unit == "GiB":
            return f"{size_bytes:.0f} {unit}" if unit == "B" else f"{size_bytes:.1f} {unit}"
        size_bytes /= 1024
    raise AssertionError("unreachable")


def format_table(rows: list[AdapterSummary]) -> str:
    if not rows:
        return "no adapters"
    header = ("NAME", "BASE", "RANK", "TARGETS", "SIZE", "METRICS")
    cells = [header] + [(r.name, r.base, r.rank, r.targets, _size(r.size_bytes), r.metrics) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def resolve_adapter_path(ref: str, store_dir: str | Path = "adapters") -> Path:
    """`ref` as a directory, else as a name in the store."""
    for candidate in (Path(ref), Path(store_dir) / ref):
        if candidate.is_dir():
            return candidate
    raise AdapterError(
        f"{ref} is neither a directory nor an adapter in the store {store_dir}; see `finetune adapters list`"
    )


def _alpha(config: dict) -> str:
    """The adapter's alpha, and the per-module alphas of its `alpha_pattern` beside it."""
    pattern = config.get("alpha_pattern") or {}
    per_module = ", ".join(f"{module}={alpha:g}" for module, alpha in sorted(pattern.items()))
    return f"{config.get('lora_alpha')}" + (f" ({per_module})" if per_module else "")


def _neither_error(path: Path) -> AdapterError:
    hint = nested_adapters_hint(path, "give an adapter directory or a model merged by finetune")
    return AdapterError(f"{path} is neither an adapter (no {CONFIG_NAME}) nor a merged model (no ledger); {hint}")


def describe(path: str | Path) -> str:
    """A human-readable description of an adapter directory or of a merged model's ledger."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        ledger = read_ledger(path)
        if ledger is None:
            raise _neither_error(path)
        lines = [f"merged model: {path}", f"base: {ledger.base_path} ({ledger.base_fingerprint})"]
        if ledger.base_quantization != "none":
            lines.append(f"base quantization (dequantized): {ledger.base_quantization}")
        lines += [f"merged: {name} weight={e.weight:g} from {e.path}" for name, e in sorted(ledger.entries.items())]
        return "\n".join(lines + ([] if ledger.entries else ["merged: nothing"]))
    summary = summarize(path)
    config = _config(path)
    manifest = read_manifest(path)
    lines = [
        f"adapter: {summary.name}",
        f"path: {path}",
        f"rank: {summary.rank}  alpha: {_alpha(config)}  rslora: {bool(config.get('use_rslora'))}  "
        f"dora: {bool(config.get('use_dora'))}",
        f"targets: {summary.targets}",
        f"size: {_size(summary.size_bytes)}",
    ]
    if manifest is None:
        lines.append(f"base: {summary.base} (no manifest.json: the base cannot be checked by fingerprint)")
    else:
        lines.append(f"base: {manifest.base.id} at {manifest.base.path} ({manifest.base.fingerprint})")
        if manifest.base.quantization != "none":
            lines.append(f"trained on a {manifest.base.quantization} base")
        if manifest.data is not None:
            lines.append(f"data: {manifest.data.fingerprint} {', '.join(manifest.data.sources)}")
        for key, value in manifest.metrics.items():
            lines.append(f"metric {key}: {value}")
        if manifest.created:
            lines.append(f"created: {manifest.created}")
        lines += [
            f"combined from: {source['name']} weight={source['weight']:g} from {source['path']}"
            for source in _combined_from(manifest, path)
        ]
    return "\n".join(lines)


def _combined_from(manifest: Manifest, path: Path) -> list[dict]:
    """The inputs `finetune adapters combine` recorded in the manifest (name, path, weight, sha256 each), checked:
    the key is free-form in the manifest, and a hand-edited one printed as a Python repr or failed in `{:g}`.
    Adapters combined before the sha256 was kept have none: null, as the ledger's entries without one."""
    recorded = (manifest.model_extra or {}).get("combined_from")
    if recorded is None:
        return []
    if not isinstance(recorded, list) or not all(map(_is_combined_input, recorded)):
        raise AdapterError(
            f"{path / MANIFEST_NAME}: combined_from is {recorded!r}, not a list of {{name, path, weight, sha256}}; "
            "fix that key or re-create the adapter with `finetune adapters combine`"
        )
    return [
        {"name": s["name"], "path": s["path"], "weight": s["weight"], "sha256": s.get("sha256") or None}
        for s in recorded
    ]


def _is_combined_input(source: object) -> bool:
    return (
        isinstance(source, dict)
        and isinstance(source.get("name"), str)
        and isinstance(source.get("path"), str)
        and isinstance(source.get("weight"), (int, float))
        and not isinstance(source.get("weight"), bool)
        and isinstance(source.get("sha256", ""), (str, type(None)))
    )


def describe_json(path: str | Path) -> dict:
    """`finetune adapters info --json`: what `describe` prints, as one object of numbers, lists and nulls.

    `kind` says which of the two it is: "adapter" or "merged_model". A figure the human lines cannot state
    (a base fingerprint without a manifest, a ledger entry's path when the ledger has none) is null, not "?"."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        return _merged_json(path)
    summary = summarize(path)
    config = _config(path)
    manifest = read_manifest(path)
    saved = config.get("modules_to_save") or []
    return {
        "kind": "adapter",
        "name": summary.name,
        "path": str(path),
        "base": _base_json(manifest, config),
        "rank": config.get("r"),
        "ranks": list(summary.ranks),
        "rank_pattern": dict(config.get("rank_pattern") or {}),
        "alpha": config.get("lora_alpha"),
        "alpha_pattern": dict(config.get("alpha_pattern") or {}),
        "targets": summary.targets.split(","),
        "rslora": bool(config.get("use_rslora")),
        "dora": bool(config.get("use_dora")),
        "modules_to_save": [saved] if isinstance(saved, str) else list(saved),
        "size_bytes": summary.size_bytes,
        **_provenance_json(manifest, path),
    }


def _base_json(manifest: Manifest | None, config: dict) -> dict:
    """The base as the manifest records it; without one only the name peft wrote, nothing checkable."""
    if manifest is None:
        named = config.get("base_model_name_or_path") or None
        return {"id": named, "path": None, "revision": None, "fingerprint": None, "dtype": None, "quantization": None}
    base = manifest.base
    return {
        "id": base.id, "path": base.path, "revision": base.revision, "fingerprint": base.fingerprint,
        "dtype": base.dtype, "quantization": base.quantization,
    }  # fmt: skip


def _provenance_json(manifest: Manifest | None, path: Path) -> dict:
    """What made the adapter, from its manifest: recipe, data, metrics, versions, and a combination's inputs."""
    if manifest is None:
        return {"recipe": None, "data": None, "metrics": {}, "versions": {}, "created": None,
                "combined_from": None, "combine_method": None}  # fmt: skip
    extra = manifest.model_extra or {}
    return {
        "recipe": manifest.recipe,
        "data": manifest.data.model_dump(mode="json") if manifest.data is not None else None,
        "metrics": dict(manifest.metrics),
        "versions": dict(manifest.versions),
        "created": manifest.created or None,
        "combined_from": _combined_from(manifest, path) if "combined_from" in extra else None,
        "combine_method": extra.get("combine_method") if isinstance(extra.get("combine_method"), str) else None,
    }


def _merged_json(path: Path) -> dict:
    """A merged model: its base, the ledger's adapters (sorted by name, as `describe` lists them) and the
    floating-point dtype its safetensors files store (from their headers; null when they mix several)."""
    ledger = read_ledger(path)
    if ledger is None:
        raise _neither_error(path)
    dtypes = _stored_dtypes(path)
    return {
        "kind": "merged_model",
        "path": str(path),
        "base": {
            "path": ledger.base_path or None,
            "fingerprint": ledger.base_fingerprint or None,
            "quantization": ledger.base_quantization,
        },  # fmt: skip
        "dtype": dtypes[0] if len(dtypes) == 1 else None,
        "dtypes": dtypes,
        "merged": [
            {
                "name": name,
                "weight": entry.weight,
                "path": entry.path or None,
                "sha256": entry.sha256 or None,
                "scaling_sha256": entry.scaling or None,
            }
            for name, entry in sorted(ledger.entries.items())
        ],  # fmt: skip
    }


def _stored_dtypes(model_dir: Path) -> list[str]:
    """The floating-point dtypes (torch's names) of the tensors in `model_dir`'s safetensors files, each file
    checked whole first by `resolve_model_dir` (a truncated shard is one line naming it, not a traceback)."""
    dtypes = {header.torch_dtype for header in TensorIndex.of(resolve_model_dir(str(model_dir))).values()}
    return sorted(str(d).removeprefix("torch.") for d in dtypes if d is not None and d.is_floating_point)
