"""Find a base model's `config.json` without loading weights or touching the network.

Where it looks, in order: `--config PATH` (a config.json or a directory holding one); the embedded base
(its shipped or built directory, else the settings it is built from); a local model directory; the hub id's snapshot
in the local hub cache; the architecture numbers shipped for the catalog's bases in
`finetune/plan/configs/<hub id>.json` (hidden size, layers, heads, vocabulary: published facts).

Example:
    config, source = find_model_config("meta-llama/Llama-3.1-8B-Instruct")   # offline, from the shipped numbers
    config.num_hidden_layers   # 32
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.embedded.cache import EMBEDDED_PREFIX, existing_embedded_base
from finetune.embedded.settings import EMBEDDED_BASES
from finetune.errors import ModelError
from finetune.paths import local_model_dir

SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_from_json(path: Path, option: str = "") -> Any:
    """A transformers config from a config.json file (its `model_type` picks the class); `option` is how the user
    named it in an error (`--config `), empty for a file found from model.base.

    Transformers 5 configs are strict dataclasses: a field of another type (`"num_hidden_layers": "32"`) raises
    huggingface_hub's StrictDataclassError, which is no ValueError, so it is caught by name here.
    """
    from huggingface_hub.errors import StrictDataclassError

    where = f"{option}{path}"
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{where}: cannot read a config.json ({exc})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ModelError(f"{where}: not a model config.json (no model_type)")
    from transformers import AutoConfig

    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, ZeroDivisionError, StrictDataclassError) as exc:
        said = " ".join(str(exc).split())[:300]  # the strict check's cause is on its second line
        raise ModelError(f"{where}: {said}; fix the file or give --config another one") from None


def _embedded_config(base: str) -> tuple[Any, str]:
    """The embedded base's config and where it was read: its directory (shipped, or built in the cache),
    else the settings it would be built from."""
    name = base.removeprefix(EMBEDDED_PREFIX)
    if name not in EMBEDDED_BASES:
        raise ModelError(f"model.base {base!r}: unknown embedded base; known: " + ", ".join(sorted(EMBEDDED_BASES)))
    found = existing_embedded_base(name)
    if found is not None:
        return config_from_json(found / "config.json"), str(found / "config.json")
    from transformers import LlamaConfig

    settings = EMBEDDED_BASES[name]
    fields: dict[str, Any] = dict(settings.shape)
    return LlamaConfig(vocab_size=settings.vocab_size, **fields), "the embedded base's build settings"


def find_model_config(base: str, revision: str | None = None, config_path: str | None = None) -> tuple[Any, str]:
    """The transformers config of `base` and where it was found (see the module docstring for where it looks).

    Raises:
        ModelError: nowhere to be found; the message says to pass `--config PATH` or download it.
    """
    if config_path is not None:
        path = Path(config_path).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ModelError(f"--config {config_path}: no such file; give a config.json or a directory holding one")
        return config_from_json(path, "--config "), str(path)
    if base.startswith("embedded:"):
        return _embedded_config(base)
    local = local_model_dir(base, revision) if Path(base).is_dir() or base.count("/") == 1 else None
    if local is not None and (local / "config.json").is_file():
        return config_from_json(local / "config.json"), str(local / "config.json")
    shipped = SHIPPED_CONFIGS / f"{base}.json"
    if base.count("/") == 1 and shipped.is_file():
        return config_from_json(shipped), "architecture numbers shipped with finetune"
    raise ModelError(
        f"config of model.base {base!r} not found (not a local model directory, not in the local hub cache, not "
        f"one of the catalog's bases); give --config PATH (its config.json) or download it: hf download {base} config.json"
    )
