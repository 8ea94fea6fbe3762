"""The training loop: recipe in, adapter directory out. Explicit code on `accelerate`.

The same loop runs on one CPU, one GPU, or many processes (DDP through `accelerate launch`). What
happens per optimizer step, in order:

1. take the next `grad_accum_steps` micro-batches of the deterministic stream (`finetune.data.sampler`);
2. count their label tokens and sum that count over processes: N;
3. for each micro-batch: loss = Σ token losses / N · num_processes, backward (gradients are only
   synchronised on the last one). DDP averages gradients over processes, hence the · num_processes:
   the result is exactly the gradient of the mean token loss over the whole global batch, however the
   tokens fall into micro-batches;
4. clip, step, schedule; report the step's metrics; evaluate and checkpoint on their intervals.

Setup (model, data, optimizer, resume) lives in `finetune.training_run`, progress reporting in
`finetune.progress` (one `on_step(step, metrics)` callback), the manifest in `finetune.manifest`.

Example:
    result = train("recipes/quickstart.yaml", ["train.max_steps=20"])
    result.adapter_dir, result.metrics["eval_ppl"]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml
from peft import PeftModel

from finetune.loss import IGNORE_INDEX, forward_loss, to_device
from finetune.manifest import Manifest, build_manifest, write_manifest
from finetune.progress import LogInterval, LogLines, MetricsFile, ProgressBar, StepCallback, fan_out
from finetune.recipe import Recipe, load_recipe, recipe_to_dict
from finetune.training_run import Batch, TrainingRun, start_run

Log = Callable[[str], None]


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrainResult(NamedTuple):
    """What `train` returns: the adapter directory and the final metrics (also in its manifest)."""

    adapter_dir: Path
    metrics: dict[str, Any]


def _real_tokens(batch: Batch) -> int:
    """Tokens of a collated batch that are not padding (padding-free batches have none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


def accumulate_gradients(model, micro_batches: list[Batch], accelerator) -> float:
    """Backward every micro-batch of one optimizer step; return the step's mean token loss.

    Each micro-batch's summed token loss is divided by the label tokens of the whole step, summed over
    processes, and multiplied by the process count (DDP averages gradients over processes): the
    gradients are those of one batch holding every token, however the tokens were split up.
    """
    local_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches)
    global_tokens = int(accelerator.reduce(torch.tensor(local_tokens, device=accelerator.device), reduction="sum"))
    loss_sum = 0.0
    for index, batch in enumerate(micro_batches):
        is_last = index == len(micro_batches) - 1
        sync = nullcontext() if is_last else accelerator.no_sync(model)
        with sync:  # the backward too: DDP all-reduces gradients during it, on the last micro-batch only
            with accelerator.autocast():
                batch_loss_sum, _ = forward_loss(model, to_device(batch, accelerator.device))
            accelerator.backward(batch_loss_sum * accelerator.num_processes / max(global_tokens, 1))
        loss_sum += batch_loss_sum.item()
    total = accelerator.reduce(torch.tensor(loss_sum, dtype=torch.float64, device=accelerator.device), reduction="sum")
    return float(total) / max(global_tokens, 1)


def run_loop(run: TrainingRun, on_step: StepCallback) -> dict[str, float]:
    """Optimizer steps until the plan's last; return the last step's training metrics ({} if none ran)."""
    train, accelerator = run.recipe.train, run.accelerator
    total_steps = run.plan.total_steps
    metrics: dict[str, float] = {}
    run.model_for_step.train()
    while run.step < total_steps:
        started = time.perf_counter()
        micro_batches = run.next_micro_batches()
        mean_loss = accumulate_gradients(run.model_for_step, micro_batches, accelerator)
        grad_norm = None
        if train.max_grad_norm is not None:
            grad_norm = accelerator.clip_grad_norm_(run.trainable_parameters, train.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)

        step_tokens = sum(_real_tokens(b) for b in micro_batches) * accelerator.num_processes
        run.step += 1
        run.position += train.grad_accum_steps
        run.tokens_seen += step_tokens
        metrics = {
            "loss": mean_loss,
            "lr": run.scheduler.get_last_lr()[0],
            "tokens_per_s": step_tokens / max(time.perf_counter() - started, 1e-9),
            "epoch": run.stream.epoch_of(run.position),
            "tokens_seen": run.tokens_seen,
        }
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        on_step(run.step, metrics)

        is_final = run.step == total_steps
        if train.eval_every_steps and run.step % train.eval_every_steps == 0 and not is_final and run.has_validation:
            on_step(run.step, run.evaluate_validation())
        if (train.save_every_steps and run.step % train.save_every_steps == 0) or is_final:
            run.save_checkpoint()
    return metrics


def final_metrics(run: TrainingRun, train_metrics: dict[str, float], eval_metrics: dict[str, float]) -> dict[str, Any]:
    """The metrics a run ends with: counters, the last step's training metrics, held-out ones against the base."""
    metrics: dict[str, Any] = {"step": run.step, "tokens_seen": run.tokens_seen, **train_metrics, **eval_metrics}
    base_eval = run.base_eval
    if base_eval:
        metrics["base_eval_loss"], metrics["base_eval_ppl"] = base_eval["eval_loss"], base_eval["eval_ppl"]
    if base_eval and eval_metrics:
        metrics["ppl_cut"] = 1 - eval_metrics["eval_ppl"] / base_eval["eval_ppl"]
        run.say(
            f"held-out perplexity: base {base_eval['eval_ppl']:.3f} -> base + adapter {eval_metrics['eval_ppl']:.3f} "
            f"({100 * metrics['ppl_cut']:.1f}% lower)"
        )
    return metrics


def write_adapter_atomically(peft_model: PeftModel, recipe: Recipe, manifest: Manifest, final_dir: Path) -> None:
    """Save the adapter into a hidden temp dir beside `final_dir`, then rename it into place."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    write_manifest(tmp, manifest)
    if final_dir.exists():
        trash = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
        final_dir.rename(trash)
        tmp.rename(final_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final_dir)


def finish_run(run: TrainingRun, train_metrics: dict[str, float], on_step: StepCallback) -> TrainResult:
    """Final evaluation, then the adapter with its manifest, written atomically by the main process."""
    eval_metrics = run.evaluate_validation()
    if eval_metrics:
        on_step(run.step, eval_metrics)
    metrics = final_metrics(run, train_metrics, eval_metrics)
    adapter_dir = run.recipe.output.adapter_dir
    if run.is_main:
        manifest = build_manifest(run.recipe, run.base_source, run.data, metrics)
        write_adapter_atomically(run.peft_model, run.recipe, manifest, adapter_dir)
        run.say(f"adapter written to {adapter_dir}")
    return TrainResult(adapter_dir, metrics)


def _reporting(
    run: TrainingRun, progress: bool | None, on_step: StepCallback | None
) -> tuple[ProgressBar, MetricsFile | None, StepCallback]:
    """The run's one step callback: the progress bar, then (main process) the metrics file and log lines on
    log steps and evaluations, then the caller's `on_step`. Also returns the bar and file, to close them."""
    total_steps = run.plan.total_steps
    show_bar = run.is_main and (sys.stderr.isatty() if progress is None else progress)
    bar = ProgressBar(total_steps=total_steps, start_step=run.step, enabled=show_bar)
    if not run.is_main:
        return bar, None, bar
    metrics_file = MetricsFile(run.recipe.output.run_path)
    lines = LogLines(run.say, total_steps=total_steps, start_step=run.step, with_steps=not show_bar)
    callbacks: list[StepCallback] = [
        bar,
        LogInterval(fan_out([metrics_file, lines]), run.recipe.train.log_every_steps, total_steps),
    ]
    if on_step is not None:
        callbacks.append(on_step)
    return bar, metrics_file, fan_out(callbacks)


def train(
    recipe_or_path: Recipe | str | Path,
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
    log: Log = _stderr_log,
    progress: bool | None = None,
    on_step: StepCallback | None = None,
) -> TrainResult:
    """Fine-tune a LoRA adapter as the recipe says; return (adapter directory, final metrics).

    Args:
        recipe_or_path: a `Recipe` or the path of a YAML recipe.
        overrides: `key=value` strings applied on top (validated like the file).
        resume: continue from the newest checkpoint in the run directory (error if there is none).
        log: where progress lines go (stderr by default; main process only).
        progress: show a progress bar; default: when stderr is a terminal.
        on_step: called as `on_step(step, metrics)` after every optimizer step and every evaluation (main
            process only; see `finetune.progress` for the metrics).
    """
    run = start_run(load_recipe(recipe_or_path, list(overrides)), resume=resume, log=log)
    if run.resumed_from is None and run.has_validation:
        run.base_eval = run.evaluate_base()
        run.say(f"base model: eval loss {run.base_eval['eval_loss']:.4f}, perplexity {run.base_eval['eval_ppl']:.3f}")
    bar, metrics_file, report = _reporting(run, progress, on_step)
    run.say(
        f"training {run.plan.total_steps} steps ({run.plan.micro_batches_per_epoch} micro-batches per epoch, "
        f"{run.recipe.train.grad_accum_steps} per step, {run.accelerator.num_processes} process(es))"
    )
    try:
        train_metrics = run_loop(run, report)
        bar.close()  # before the final evaluation's lines
        result = finish_run(run, train_metrics, report)
    finally:
        bar.close()
        if metrics_file is not None:
            metrics_file.close()
    run.accelerator.wait_for_everyone()
    return result
