"""`manifest.json`: what made an adapter (base, recipe, data) and how well it did.

It sits beside peft's `adapter_config.json` and `adapter_model.safetensors` in an adapter directory;
plain peft ignores it, `finetune` reads it to find the base, check fingerprints and list the store.

Example:
    manifest = read_manifest(Path("adapters/legal"))
    manifest.base.path, manifest.base.fingerprint
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from finetune import strict_json
from finetune.errors import AdapterError
from finetune.recipe import recipe_to_dict
from finetune.version import __version__

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "finetune-adapter/1"


class BaseInfo(BaseModel):
    """The base model an adapter was trained on."""

    model_config = ConfigDict(extra="allow")

    id: str
    """As the recipe named it (a hub id, a path, or `embedded:tiny-llama`)."""
    path: str
    """What `from_pretrained` loads: a local directory or a hub id."""
    revision: str | None = None
    fingerprint: str
    """`finetune.fingerprint` of the base weights, e.g. `sha256:ab12...`."""
    dtype: str | None = None
    quantization: str = "none"


class DataInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    fingerprint: str
    sources: list[str] = []
    stats: dict[str, Any] = {}


class Manifest(BaseModel):
    """The contents of `manifest.json`."""

    model_config = ConfigDict(extra="allow")

    format: str = MANIFEST_FORMAT
    name: str
    base: BaseInfo
    recipe: dict[str, Any] | None = None
    data: DataInfo | None = None
    metrics: dict[str, Any] = {}
    distributed: dict[str, Any] | None = None
    """How the run was distributed: `{strategy, world_size, max_rank_param_share}` (`finetune.training.sharding`)."""
    versions: dict[str, str] = {}
    created: str = ""


def build_manifest(
    recipe: Any,
    *,
    base_source: str,
    base_fingerprint: str,
    data: Any,
    metrics: dict[str, Any],
    distributed: dict[str, Any] | None = None,
) -> Manifest:
    """The manifest of an adapter that `recipe` trained on `base_source` with `data` (a `DataBundle`)."""
    return Manifest(
        name=recipe.output.name,
        base=BaseInfo(
            id=recipe.model.base,
            path=base_source,
            revision=recipe.model.revision,
            fingerprint=base_fingerprint,
            dtype=recipe.model.dtype,
            quantization=recipe.model.quantization,
        ),
        recipe=recipe_to_dict(recipe),
        data=DataInfo(fingerprint=data.fingerprint, sources=[s.path for s in recipe.data.train], stats=data.stats),
        metrics=metrics,
        distributed=distributed,
        versions=library_versions(),
        created=now_iso(),
    )


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape an adapter's numbers."""
    # Imported here, not above: reading a manifest (`finetune adapters list`) must not load torch. The
    # libraries' versions come from their installed metadata: importing accelerate or peft costs seconds.
    from importlib.metadata import version

    import torch

    return {
        "finetune": __version__,
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "accelerate": version("accelerate"),
    }


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_manifest(adapter_dir: Path, manifest: Manifest) -> None:
    """Write `manifest.json` into `adapter_dir` (callers write the whole directory atomically)."""
    (adapter_dir / MANIFEST_NAME).write_text(strict_json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")


def read_manifest(adapter_dir: Path) -> Manifest | None:
    """The adapter's manifest, or None for a plain peft adapter that has none."""
    path = Path(adapter_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return Manifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (ValidationError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        first = str(exc).splitlines()[0]
        raise AdapterError(f"{path} is not a valid finetune manifest ({first}); re-create the adapter") from None
