"""The training loop: recipe in, adapter directory out. Explicit code on `accelerate`.

The same loop runs on one CPU, one GPU, or many processes (`accelerate launch`; DDP or FSDP, see
`finetune.training.sharding`). Setup
lives in `finetune.training.run` (the `TrainingRun` state), reporting in `finetune.training.progress` (one
`on_step` callback). What happens per optimizer step, in order:

1. take the next `grad_accum_steps` micro-batches of the deterministic stream (`finetune.data.sampler`);
2. count the units the objective normalises by (`finetune.training.objectives`: label tokens for SFT,
   pairs for DPO/ORPO/SimPO, examples for KTO) and sum each over processes: N_u;
3. let the objective do the step's no-grad work (reference log-probabilities, KTO's KL baseline);
4. for each micro-batch: loss = Σ_u (Σ of the loss over u) / N_u · num_processes, backward (gradients
   are only synchronised on the last one). DDP averages gradients over processes, hence the
   · num_processes: the result is exactly the gradient of the mean loss over the whole global batch,
   however its tokens or pairs fall into micro-batches; the step's loss and metrics are summed as
   tensors and reduced once, at the end of the step;
5. clip; stop (or skip, if the recipe allows: then the schedule waits too) on a NaN/Inf loss or gradient;
   step, schedule;
6. report the step, evaluate and checkpoint on their intervals; on SIGINT/SIGTERM checkpoint and stop.

Example:
    result = train("recipes/quickstart.yaml", ["train.max_steps=20"])
    result.adapter_dir, result.metrics["eval_ppl"]
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from finetune.device import to_device
from finetune.errors import TrainingError
from finetune.manifest import read_manifest
from finetune.recipe import Recipe, load_recipe
from finetune.report import report_finished_run
from finetune.signals import StopRequest
from finetune.training import checkpoint as ckpt
from finetune.training.finish import finish_run
from finetune.training.interrupt import TrainingInterrupted, graceful_stop, stop_agreed
from finetune.training.objectives.base import Models, Objective, summarise
from finetune.training.objectives.sft import BATCH_SFT
from finetune.training.progress import Say, StepCallback, TrainingLog, fan_out
from finetune.training.run import TrainingRun, start_run
from finetune.training.sharding import DdpSharding, Sharding
from finetune.training.tracking import Trackers

SLOW_STEP_ENV = "FINETUNE_TEST_SECONDS_PER_STEP"


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrainResult(NamedTuple):
    adapter_dir: Path
    metrics: dict[str, Any]


def train(
    recipe_or_path: Recipe | str | Path,
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
    log: Say = _stderr_log,
    progress: bool | None = None,
    on_step: StepCallback | None = None,
) -> TrainResult:
    """Fine-tune a LoRA adapter as the recipe says; return (adapter directory, final metrics).

    Args:
        recipe_or_path: a `Recipe` or the path of a YAML recipe.
        overrides: `key=value` strings applied on top (validated like the file).
        resume: continue from the newest checkpoint in the run directory (error if there is none).
        log: where progress lines go (stderr by default).
        progress: show a progress bar; default: when stderr is a terminal.
        on_step: called after every optimizer step with its metrics (see `finetune.training.progress`).

    Raises:
        TrainingError: a NaN/Inf loss or gradient (beyond `train.nonfinite_skips`); no adapter is written.
        TrainingInterrupted: SIGINT/SIGTERM; a checkpoint of the last finished step was written.
    """
    recipe = load_recipe(recipe_or_path, list(overrides))
    started = time.perf_counter()
    run = start_run(recipe, resume=resume, say=log)
    if resume and run.step == run.length.total_steps and recipe.output.adapter_dir.exists():
        log(f"the run had finished: its adapter is {recipe.output.adapter_dir}")  # killed after writing it
        return TrainResult(recipe.output.adapter_dir, _recorded_metrics(recipe.output.adapter_dir))
    say = log if run.is_main else (lambda message: None)
    show_bar = run.is_main and (sys.stderr.isatty() if progress is None else progress)
    trackers = Trackers.start(run.accelerator, recipe, run.base_eval, run.step)
    training_log = TrainingLog(
        run.run_dir if run.is_main else None,
        total_steps=run.length.total_steps,
        first_step=run.step,
        log_every_steps=recipe.train.log_every_steps,
        say=say,
        show_bar=show_bar,
        record=trackers.log,
    )
    say(
        f"training {run.length.total_steps} steps ({run.length.micro_batches_per_epoch} micro-batches per epoch, "
        f"{recipe.train.grad_accum_steps} per step, {run.accelerator.num_processes} process(es))"
    )
    try:
        with graceful_stop(say) as stop:
            last = run_steps(run, stop, fan_out(training_log, on_step))
        final_eval = run.evaluate()
        training_log.log_eval(run.step, final_eval)
    finally:
        training_log.close()
        trackers.close()
    wall = {"wall_seconds": time.perf_counter() - started}
    result = TrainResult(*finish_run(run, {**last, **final_eval, **wall}, say))
    if run.is_main:
        report_finished_run(run.run_dir, result.adapter_dir, html=recipe.output.report, say=say)
    return result


def _recorded_metrics(adapter_dir: Path) -> dict[str, Any]:
    manifest = read_manifest(adapter_dir)
    return dict(manifest.metrics) if manifest is not None else {}


def run_steps(run: TrainingRun, stop: StopRequest, on_step: StepCallback) -> dict[str, float]:
    """Optimizer steps until the run's length; returns the metrics of the last step and evaluation."""
    train_config = run.recipe.train
    run.model_for_step.train()
    start_time, skipped_steps = time.perf_counter(), 0
    last: dict[str, float] = {}
    while run.step < run.length.total_steps:
        step_started = time.perf_counter()
        micro_batches = run.next_micro_batches()
        loss, step_metrics = accumulate_gradients(
            run.model_for_step, micro_batches, run.accelerator, run.sharding, run.objective, run.peft_model
        )
        max_norm = train_config.max_grad_norm or math.inf  # inf: measure the norm (for the NaN check), clip nothing
        grad_norm = run.sharding.clip_grad_norm(run.accelerator, run.trainable_parameters, max_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            skipped_steps += 1
            _refuse_nonfinite(run, loss, grad_norm, skipped_steps)
        else:  # a skipped step changes nothing: not the weights, not Adam's state, not the schedule
            run.optimizer.step()
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.advance(micro_batches)

        last = {**last, **step_metrics, "loss": loss, "grad_norm": grad_norm, "lr": run.scheduler.get_last_lr()[0]}
        last.update(tokens_seen=run.tokens_seen, epoch=run.stream.epoch_of(run.position))
        last.update(elapsed_s=time.perf_counter() - start_time, skipped_steps=skipped_steps)
        last.update(step_s=time.perf_counter() - step_started)
        is_final = run.step == run.length.total_steps
        if not is_final and train_config.eval_every_steps and run.step % train_config.eval_every_steps == 0:
            last.update(run.evaluate())
        on_step(run.step, last)
        _test_hook_slow_step()
        last = {k: v for k, v in last.items() if not k.startswith("eval_")}  # an evaluation is reported once
        if is_final or (train_config.save_every_steps and run.step % train_config.save_every_steps == 0):
            run.save_checkpoint()
        if not is_final and stop_agreed(stop, run.accelerator):
            path = run.save_checkpoint()
            raise TrainingInterrupted(
                f"interrupted at step {run.step} of {run.length.total_steps}; checkpoint {path} written; run the same "
                "`finetune train` command with --resume to continue",
                stop.signal_number or 2,
            )
    return last


def _test_hook_slow_step() -> None:
    """Tests sleep here (`FINETUNE_TEST_SECONDS_PER_STEP`) to signal a run at a known point; 0 by default."""
    seconds = float(os.environ.get(SLOW_STEP_ENV, "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


def _refuse_nonfinite(run: TrainingRun, loss: float, grad_norm: float, skipped_steps: int) -> None:
    """Stop on a NaN/Inf step, unless the recipe allows skipping it (then nothing is updated)."""
    allowed = run.recipe.train.nonfinite_skips
    if skipped_steps <= allowed:
        return

    last_good = ckpt.latest_checkpoint(run.run_dir)
    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
    raise TrainingError(
        f"step {run.step + 1}: loss {loss} and gradient norm {grad_norm} are not finite (after {skipped_steps - 1} "
        f"allowed skips); no adapter was written; {where}; lower train.lr, use train.precision=fp32, or allow "
        "skips with train.nonfinite_skips"
    )


class StepLoss(NamedTuple):
    loss: float
    metrics: dict[str, float]
    """The objective's metrics over the step (means over their units, all processes): {} for SFT."""


def accumulate_gradients(
    model: Any,
    micro_batches: list[dict[str, torch.Tensor]],
    accelerator: Any,
    sharding: Sharding | None = None,
    objective: Objective | None = None,
    peft_model: Any = None,
) -> StepLoss:
    """Backward every micro-batch of one optimizer step; return the step's loss and metrics.

    Each micro-batch's loss, summed over each normalisation unit of the objective (label tokens for SFT,
    the default), is divided by that unit's count over the whole step, summed over processes, and
    multiplied by the process count (DDP and FSDP average gradients over processes): the gradients are
    those of one batch holding everything, however it was split up. `peft_model` is `model` unwrapped
    (default: `model`), for the objective's no-grad passes.
    """
    sharding = sharding or DdpSharding()
    objective = objective if objective is not None else BATCH_SFT
    models = Models(model, model if peft_model is None else peft_model, accelerator)
    counts = _step_counts(objective, micro_batches, accelerator)  # on the device: nothing waits for them
    batches = [to_device(batch, accelerator.device) for batch in micro_batches]
    with accelerator.autocast():
        prepared = objective.prepare(models, batches, reduce=True)
    sums: dict[str, torch.Tensor] = {}
    for index, (batch, state) in enumerate(zip(batches, prepared)):
        is_last = index == len(batches) - 1
        with sharding.gradient_sync(accelerator, model, sync=is_last):  # the backward too: it reduces gradients
            with accelerator.autocast():
                terms = objective.terms(models, batch, state)
            loss: Any = None
            for unit in objective.loss_units:
                count = counts[unit].clamp(min=1).to(terms.losses[unit].dtype)
                term = terms.losses[unit] * accelerator.num_processes / count
                loss = term if loss is None else loss + term
            sharding.backward(accelerator, loss)
        named = {f"loss/{unit}": value for unit, value in terms.losses.items()} | terms.metrics
        for name, value in named.items():
            sums[name] = sums.get(name, 0) + value.detach().double()
    names = sorted(sums)
    totals = accelerator.reduce(torch.stack([sums[name] for name in names]), reduction="sum")
    values = torch.cat([totals, torch.stack([counts[unit] for unit in objective.count_units])]).tolist()  # one sync
    reported = summarise(objective, dict(zip(names, values)), dict(zip(objective.count_units, values[len(names) :])))
    return StepLoss(reported.pop("loss"), {name: value for name, value in reported.items() if name != "ppl"})


def _step_counts(objective: Objective, micro_batches: list[dict[str, torch.Tensor]], accelerator: Any) -> dict:
    """Each unit's count over the step's micro-batches (counted on the host) and every process, as float64 on
    the device."""
    local = [0] * len(objective.count_units)
    for batch in micro_batches:
        batch_counts = objective.counts(batch)
        local = [total + batch_counts[unit] for total, unit in zip(local, objective.count_units)]
    reduced = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), reduction="sum")
    return dict(zip(objective.count_units, reduced))
