"""What a checkpoint records of its recipe, and whether a recipe may resume it, setting by setting.

A checkpoint stores the resolved `model`, `lora`, `data` and `train` sections (less the train settings a
resume may change: length, intervals, trackers). A later finetune may add settings to those sections; a
checkpoint written before has none of them, and the run it belongs to ran as their defaults say. So the
recorded sections are read through today's schema, which fills each added setting with its default, and
then compared key by key: the first setting that differs is named with both values, in one line.

Example:
    state = {"recipe_digest": recipe_digest(recipe), ...}           # when saving
    problem = resume_mismatch(state["recipe_digest"], recipe)       # when resuming: None, or what differs
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from finetune.recipe import Recipe, recipe_to_dict

SECTIONS = ("model", "lora", "data", "train")

# Train settings that may change between a checkpoint and its resumption: length, intervals, trackers.
RESUMABLE_TRAIN_KEYS = (
    "epochs",
    "max_steps",
    "log_every_steps",
    "eval_every_steps",
    "save_every_steps",
    "keep_checkpoints",
    "eval_max_batches",
    "report_to",
    "tracker_project",
    "compile",  # how a step is computed, not what it computes
    "varlen_attention",
    "gradient_checkpointing",  # `auto` may choose otherwise on another device; the step computes the same
)


def recipe_digest(recipe: Recipe) -> dict[str, Any]:
    """The parts of a recipe a checkpoint must agree with to be resumed (length and intervals may change)."""
    resolved = recipe_to_dict(recipe)
    digest = {section: resolved[section] for section in SECTIONS}
    digest["train"] = _without_resumable(digest["train"])
    return digest


def resume_mismatch(recorded: dict[str, Any], recipe: Recipe) -> str | None:
    """The first setting that differs between a checkpoint's recorded digest and `recipe`, as
    "`dotted.key` is A in the checkpoint but B now", or None when the recipe may resume it.

    Settings the checkpoint lacks (added to finetune since it was written) take their defaults first, so
    an upgrade that adds a setting resumes unless the recipe sets it to something else than its default.
    """
    current = recipe_digest(recipe)
    recorded = _without_unused_embedding_lr(recorded)
    for section in SECTIONS:
        then = _flatten(_with_defaults(section, recorded.get(section, {})))
        now = _flatten(current[section])
        for key in dict.fromkeys([*now, *then]):  # today's order first, then settings since removed
            before, after = then.get(key, _ABSENT), now.get(key, _ABSENT)
            if before != after:
                return f"{section}.{key} is {_show(before)} in the checkpoint but {_show(after)} now"
    return None


def _without_unused_embedding_lr(recorded: dict[str, Any]) -> dict[str, Any]:
    """`recorded` less a `train.embedding_lr` that applied to nothing: a checkpoint written before the recipe
    refused the rate beside no head or embedding LoRA (`Recipe._embedding_lr_has_weights`) trained as if it were
    absent, so the recipe it must now be resumed with, which leaves it out, computes the same steps."""
    lora, train = recorded.get("lora", {}), recorded.get("train", {})
    switched_on = lora.get("train_lm_head") or lora.get("train_embed_tokens")
    if train.get("embedding_lr") is None or switched_on or lora.get("target_modules", "all-linear") != "all-linear":
        return recorded
    return {**recorded, "train": {key: value for key, value in train.items() if key != "embedding_lr"}}


class _Absent:
    def __repr__(self) -> str:
        return "unset"


_ABSENT = _Absent()


def _with_defaults(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """A recorded section read through today's schema: settings added since then get their defaults.
    Settings since removed are kept as recorded (and so differ); a section today's schema refuses
    otherwise is compared as recorded."""
    schema = Recipe.model_fields[section].annotation
    assert isinstance(schema, type) and issubclass(schema, BaseModel), section
    removed = {key: value for key, value in values.items() if key not in schema.model_fields}
    try:
        filled = schema.model_validate({k: v for k, v in values.items() if k not in removed}).model_dump(mode="json")
    except ValidationError:
        return values
    filled = _without_resumable(filled) if section == "train" else filled
    return {**filled, **removed}


def _without_resumable(train: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in train.items() if key not in RESUMABLE_TRAIN_KEYS}


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as `{dotted.key: value}`; lists are one value (their order matters)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, (str, _Absent)) else str(value).replace("'", "")
