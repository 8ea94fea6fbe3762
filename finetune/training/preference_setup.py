"""Setup a preference run needs before its first step: LoRA started from an adapter, and precomputed references.

- `initial_adapter`: `lora.init_from` loads an existing adapter's weights (an SFT adapter the preference
  run refines) into the freshly wrapped LoRA model, after checking that it was trained on this base and
  with this section's rank, alpha and targets, so the model starts as base + that adapter.
- `precomputed_reference`: with `train.precompute_reference`, the reference policy's log-probabilities of
  the training pairs the run trains on and every validation pair, from the model as it starts
  (`objectives.reference.score_rows`), kept in the run directory and added to the rows. A resumed run reads
  them back (the values the interrupted run used, bit for bit); it scores the pairs the file lacks (the file
  is missing, or the run was lengthened) before restoring the checkpoint, so still from the starting model.

Example:
    initial_adapter(recipe, peft_model, base, say)
    data = precomputed_reference(recipe, objective, models, data, trained_rows=stream.rows_trained_on(800),
                                 resume=False, say=print)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any

import torch

from finetune.adapters.fit import check_fingerprint
from finetune.adapters.lora import Adapter, read_adapter
from finetune.adapters.resolved_base import ResolvedBase
from finetune.errors import AdapterError, ModelError
from finetune.recipe import Recipe, recipe_to_dict
from finetune.training.mutated_start import keep_start
from finetune.training.objectives.base import Models, Objective
from finetune.training.objectives.reference import load_or_compute, score_rows, with_reference_columns
from finetune.training.sharding import trainable_names

Say = Callable[[str], None]


def initial_adapter(recipe: Recipe, peft_model: Any, base: ResolvedBase, say: Say) -> None:
    """Copy `lora.init_from`'s weights into `peft_model`; without it, keep a PiSSA/OLoRA start in the run directory
    (`finetune.training.mutated_start`: the adapter is written as an update of the base on disk).

    Raises:
        AdapterError: the adapter is unreadable or was trained on another base.
        ModelError: its rank, alpha, scaling or targeted modules are not this recipe's LoRA.
    """
    source = recipe.lora.init_from
    if source is None:
        keep_start(recipe, peft_model)
        return
    try:
        adapter = read_adapter(source)
    except AdapterError as exc:
        raise AdapterError(f"lora.init_from: {exc}") from None
    check_fingerprint(adapter, base.weights_fingerprint, recipe.model.base, force=False)
    config, lora = adapter.config, recipe.lora
    settings = {"r": lora.r, "lora_alpha": lora.alpha, "use_rslora": lora.use_rslora, "use_dora": lora.use_dora}
    differs = {key: config.get(key) for key, value in settings.items() if (config.get(key) or False) != value}
    tensors = {name: t for module, w in adapter.modules.items() for name, t in w.peft_tensors(module).items()}
    try:
        state = trainable_names(peft_model, tensors)
    except KeyError:
        state = {}
    trainable = {name: p for name, p in peft_model.named_parameters() if p.requires_grad}
    shapes_match = state.keys() == trainable.keys() and all(state[n].shape == trainable[n].shape for n in state)
    if differs or not shapes_match:
        raise ModelError(
            f"lora.init_from {source}: its LoRA ({', '.join(f'{k}={v}' for k, v in config.items() if k in settings)}, "
            f"{len(adapter.modules)} modules) is not this recipe's lora section; leave lora.r, lora.alpha and "
            "lora.target_modules out (they are then the adapter's) or set them, and train_lm_head/train_embed_tokens, "
            "as in the recipe that trained it"
        )
    _check_scales(source, adapter, peft_model)
    with torch.no_grad():
        for name, tensor in state.items():
            trainable[name].copy_(tensor.to(trainable[name].dtype))
    say(f"LoRA starts from {source} ({len(adapter.modules)} modules)")


def _check_scales(source: str, adapter: Adapter, peft_model: Any) -> None:
    """Refuse a starting adapter whose per-module scale (its `alpha_pattern`, or a `rank_pattern` rank under
    rsLoRA) is not the run's: the recipe has one alpha, so its weights copied under the run's scale started
    another model than the adapter (q_proj at alpha 32 trained as alpha 8), and the adapter written at the end
    was that other model, without a word. r, alpha and rsLoRA are compared before; this compares what they and
    the patterns give each module, as peft computes it."""
    for name, module in peft_model.named_modules():
        weights = adapter.modules.get(name.removeprefix("base_model.model."))
        scaling = getattr(module, "scaling", None)
        if weights is None or not isinstance(scaling, dict) or "default" not in scaling:
            continue
        if not math.isclose(weights.scale, scaling["default"], rel_tol=1e-9):
            raise ModelError(
                f"lora.init_from {source}: module {name.removeprefix('base_model.model.')} is scaled "
                f"{weights.scale:g} in the adapter (its alpha_pattern/rank_pattern) but {scaling['default']:g} "
                "in this run, which has one alpha for every module; start from an adapter without per-module "
                "alphas, or merge it into the base and train a new adapter on the merged model"
            )


def reference_digest(recipe: Recipe, data_fingerprint: str) -> str:
    """What precomputed reference log-probabilities depend on: the recipe's model, LoRA and data, and the data."""
    resolved = recipe_to_dict(recipe)
    inputs = {key: resolved[key] for key in ("model", "lora", "data")}
    inputs.update(precision=recipe.train.precision, data_fingerprint=data_fingerprint)
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def precomputed_reference(
    recipe: Recipe, objective: Objective, models: Models, data: Any, *, trained_rows: list[int], resume: bool, say: Say
) -> Any:
    """`data` with the reference log-probabilities of its pairs added as columns (itself without
    `train.precompute_reference`): the training pairs in `trained_rows` (those the run's steps take: a
    100-step run of 8 pairs a step scores 800 pairs, not a whole dataset of 60,000) and every validation pair.
    Other training pairs get NaN, which no step reads."""
    if not recipe.train.precompute_reference:
        return data
    accelerator = models.accelerator
    batch_size = recipe.train.micro_batch_size

    def complete(stored: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        values = dict(stored or {})
        train = values.get("train")
        missing = trained_rows
        if train is not None:  # the rows an earlier start of the run stored NaN for (one vectorised test)
            rows = torch.tensor(trained_rows, dtype=torch.long)
            missing = rows[train[rows].isnan().any(dim=1)].tolist()
        if missing:
            say(f"reference: scoring {len(missing)} of {len(data.train)} training pairs (those the run trains on) "
                "once with the starting model")  # fmt: skip
            scores = score_rows(objective, models, data.train.select(missing), batch_size)
            if train is None:
                train = torch.full((len(data.train), scores.shape[1]), float("nan"))
            values["train"] = train.clone().index_copy_(0, torch.tensor(missing), scores)
        if data.validation is not None and "validation" not in values:
            values["validation"] = score_rows(objective, models, data.validation, batch_size)
        return values

    values = load_or_compute(
        recipe.output.run_path,
        reference_digest(recipe, data.fingerprint),
        complete,
        resume=resume,
        is_main=bool(accelerator.is_main_process),
        wait=accelerator.wait_for_everyone,
    )
    train = with_reference_columns(data.train, values["train"])
    validation = data.validation
    if validation is not None:
        validation = with_reference_columns(validation, values["validation"])
    return dataclasses.replace(data, train=train, validation=validation)
