"""The end of a training run: the summary metrics, the manifest, and the adapter directory, written whole.

The adapter is saved by peft into a staging directory beside `adapters/<name>/` together with the
resolved recipe, the manifest and the tokenizer the run used (with its chat template), and renamed into
place only when all of it is written (`finetune.atomic`): a run that fails or is killed never leaves a
partial adapter.

Example:
    adapter_dir, metrics = finish_run(run, {**last_step_metrics, **final_eval}, say=print)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate.utils import gather_object

from finetune.atomic import atomic_directory
from finetune.errors import OutputError
from finetune.manifest import build_manifest, write_manifest
from finetune.recipe import recipe_to_dict
from finetune.report.runs import perplexity_change
from finetune.training.mutated_start import as_plain_lora, plain_lora_config
from finetune.training.objectives.base import describe_rewards
from finetune.training.run import TrainingRun, check_output_free


def summary_metrics(run: TrainingRun, last: dict[str, float], say: Callable[[str], None]) -> dict[str, Any]:
    """The metrics recorded in the manifest: the last step's, the final evaluation and the start's (the base's,
    or a starting adapter's: `Recipe.start_metrics_prefix`)."""
    metrics: dict[str, Any] = {"step": run.step, **last, "tokens_seen": run.tokens_seen}
    base_eval, prefix = run.base_eval, run.recipe.start_metrics_prefix
    if base_eval:
        for key in ("eval_loss", "eval_ppl", "eval_reward_accuracy", "eval_reward_margin", "eval_reward"):
            if key in base_eval:  # the rewards: preference or grpo, at its start
                metrics[f"{prefix}{key}"] = base_eval[key]
    if base_eval and "eval_ppl" in last:
        cut = 1 - last["eval_ppl"] / base_eval["eval_ppl"]
        metrics["ppl_cut"] = cut
        change = perplexity_change(base_eval["eval_ppl"], last["eval_ppl"])
        if run.recipe.train.objective == "grpo" and "eval_reward" in base_eval and "eval_reward" in last:
            say(
                f"held-out reward of sampled completions: start {base_eval['eval_reward']:.3f} -> {last['eval_reward']:.3f}"
            )
        elif run.recipe.train.objective == "sft":
            say(
                f"held-out perplexity: base {base_eval['eval_ppl']:.3f} -> base + adapter {last['eval_ppl']:.3f} ({change})"
            )
        else:
            say(
                f"held-out perplexity of the chosen completions: start {base_eval['eval_ppl']:.3f} -> "
                f"{last['eval_ppl']:.3f} ({change}); eval loss {last['eval_loss']:.4f}{describe_rewards(last, 'eval_')}"
            )
    return metrics


def peak_memory_bytes() -> int:
    """This process's peak: allocated device memory on a GPU, resident host memory otherwise."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def write_adapter(run: TrainingRun, metrics: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    """Write `adapters/<name>/` whole: peft's files (of `weights`, the whole trained tensors as
    `StateIO.trainable_state` gathers them), the resolved recipe, the manifest and the run's tokenizer."""
    recipe = run.recipe
    manifest = build_manifest(
        recipe,
        base_source=run.base.source,
        base_fingerprint=run.base.weights_fingerprint or "unknown",
        data=run.data,
        metrics=metrics,
        distributed=dataclasses.asdict(run.distributed),
    )
    adapter_dir = recipe.output.adapter_dir
    check_output_free(recipe)  # again: on --resume it was not checked at the start, and the place may have changed
    hint = "choose another output.name, or set output.overwrite=true"
    with atomic_directory(adapter_dir, replace=recipe.output.overwrite, error=OutputError, hint=hint) as staging:
        run.peft_model.save_pretrained(
            staging, safe_serialization=True, save_embedding_layers=False, state_dict=as_plain_lora(recipe, weights)
        )
        plain_lora_config(recipe, staging / "adapter_config.json")
        sort_target_modules(staging / "adapter_config.json")
        (staging / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
        write_manifest(staging, manifest)
        save_tokenizer(run.tokenizer, recipe.data.chat_template, staging)
    return adapter_dir


def sort_target_modules(config_file: Path) -> None:
    """Write `target_modules` sorted: peft keeps them as a set and writes the set's order, which changes with each
    process's string hashing, so two runs of one recipe wrote equal weights but different adapter_config.json."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


def save_tokenizer(tokenizer: Any, chat_template: str | None, out_dir: Path) -> None:
    """Save the run's tokenizer into the adapter directory, with the chat template the run rendered with
    (`data.chat_template` where set, which the tokenizer object itself does not hold), as trl's trainers save
    theirs: `finetune generate --chat`, `serve` and `AutoTokenizer.from_pretrained(adapter)` then prompt as
    training did, where the base's tokenizer has another template or none, or the run used `model.tokenizer`."""
    own = tokenizer.chat_template
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    try:
        tokenizer.save_pretrained(out_dir)
    finally:
        tokenizer.chat_template = own  # the run's object as it was: the data pipeline passes the template itself


def finish_run(run: TrainingRun, last: dict[str, float], say: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """Summarise, write the adapter (main process), wait for every process; return (adapter dir, metrics)."""
    metrics = summary_metrics(run, last, say)
    metrics["peak_memory_bytes_per_rank"] = gather_object([peak_memory_bytes()])  # every process: a collective
    weights = run.sharding.state.trainable_state(
        run.peft_model
    )  # every process: gathering sharded weights is a collective
    if run.is_main:
        write_adapter(run, metrics, weights)
        say(f"adapter written to {run.recipe.output.adapter_dir}")
    run.accelerator.wait_for_everyone()
    return run.recipe.output.adapter_dir, metrics
