"""The training loop: recipe in, adapter directory out. Explicit code on `accelerate`.

The same loop runs on one CPU, one GPU, or many processes (`accelerate launch`; DDP or FSDP, see
`finetune.training.sharding`). Setup
lives in `finetune.training.run` (the `TrainingRun` state), reporting in `finetune.training.progress` (one
`on_step` callback). What happens per optimizer step, in order:

1. take the next `grad_accum_steps` micro-batches of the deterministic stream (`finetune.data.sampler`; the
   last step of a run set by `train.epochs` takes those left, which may be fewer);
2. count the units the objective normalises by (`finetune.training.objectives`: label tokens for SFT,
   pairs for DPO/ORPO/SimPO, examples for KTO) and sum each over processes: N_u;
3. let the objective do the step's no-grad work (reference log-probabilities, KTO's KL baseline);
4. for each micro-batch: loss = Σ_u (Σ of the loss over u) / N_u · num_processes, backward (gradients
   are only synchronised on the last one). DDP averages gradients over processes, hence the
   · num_processes: the result is exactly the gradient of the mean loss over the whole global batch,
   however its tokens or pairs fall into micro-batches; the step's loss and metrics are summed as
   tensors and reduced once, at the end of the step;
5. clip; step fused AdamW, which skips a step whose loss or gradient norm is NaN/Inf on the device, and
   advance the learning-rate schedule on the device by the steps actually taken
   (`finetune.training.device_schedule`): nothing in a step waits on the device (`tests/test_host_sync.py`);
6. read the queued steps' metrics in one copy at the logging interval (and before an evaluation, a
   checkpoint or a stop, and at the end): stop there on a NaN/Inf step beyond `train.nonfinite_skips`
   (nothing was updated by it), report each step, evaluate and checkpoint on their intervals; on
   SIGINT/SIGTERM checkpoint and stop (with several processes, at the next read).

Example:
    result = train("recipes/quickstart.yaml", ["train.max_steps=20"])
    result.adapter_dir, result.metrics["eval_ppl"]
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from finetune.device import to_device
from finetune.errors import RecipeError, TrainingError
from finetune.manifest import read_manifest
from finetune.recipe import Recipe, load_recipe
from finetune.report import report_finished_run
from finetune.signals import StopRequest
from finetune.training.device_schedule import DeviceSchedule
from finetune.training.finish import finish_run
from finetune.training.interrupt import TrainingInterrupted, graceful_stop, stop_agreed
from finetune.training.objectives.base import Models, Objective, summarise
from finetune.training.objectives.sft import BATCH_SFT
from finetune.training.out_of_memory import is_out_of_memory, out_of_memory_line
from finetune.training.progress import Say, StepCallback, TrainingLog, fan_out
from finetune.training.recipe_digest import SECTIONS, resume_mismatch
from finetune.training.run import TrainingRun, start_run
from finetune.training.run_files import adapter_taken, checkpoint_path, latest_checkpoint
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
        on_step: called after every optimizer step with its metrics (see `finetune.training.progress`); the final
            evaluation, after the last step, is in the returned `TrainResult.metrics`.

    Raises:
        TrainingError: a NaN/Inf loss or gradient (beyond `train.nonfinite_skips`), or out of GPU or host memory
            (one line naming the settings that lower the peak: `out_of_memory`); no adapter is written.
        TrainingInterrupted: SIGINT/SIGTERM; a checkpoint of the last finished step was written.
    """
    recipe = load_recipe(recipe_or_path, overrides)
    try:
        with callers_random_state_kept():
            return _train(recipe, resume=resume, log=log, progress=progress, on_step=on_step)
    except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(error):
            raise
        line = out_of_memory_line(recipe, error)
    raise TrainingError(line)  # outside the handler: nothing keeps the failed step's frames and tensors


@contextmanager
def callers_random_state_kept() -> Iterator[None]:
    """Give the caller back the global RNGs (torch's CPU and CUDA ones, Python's `random`, numpy's) as they were.

    A run seeds them all with `train.seed` (accelerate's `set_seed`, right before LoRA initialises) and draws
    from them while it trains. From the Python API that reset the notebook's own generators: after
    `torch.manual_seed(0); finetune.train(...)`, `torch.rand`, `random.random()` and `np.random.rand()` gave what
    the recipe's seed and the run's draws left, the same after every run, whatever the caller had seeded.
    """
    import numpy as np

    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    # CUDA's only where already initialised: initialising it here would touch every device before the run chose one
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def _train(
    recipe: Recipe, *, resume: bool, log: Say, progress: bool | None, on_step: StepCallback | None
) -> TrainResult:
    started = time.perf_counter()
    run = start_run(recipe, resume=resume, say=log)
    if resume and run.step == run.length.total_steps and _adapter_of_this_run(run):
        log(f"the run had finished: its adapter is {recipe.output.adapter_dir}")  # killed after writing it
        return TrainResult(recipe.output.adapter_dir, _recorded_metrics(recipe.output.adapter_dir))
    if resume and not recipe.output.overwrite and adapter_taken(recipe):  # else refused after the last step
        raise RecipeError(
            f"output: {recipe.output.adapter_dir} already exists and is not this run's adapter, so this run could "
            "not write its own at the end; resume with output.overwrite=true to replace it then"
        )
    say = log if run.is_main else (lambda message: None)
    show_bar = run.is_main and (sys.stderr.isatty() if progress is None else progress)
    trackers = Trackers.start(run.accelerator, recipe, run.base_eval, run.step)
    training_log = TrainingLog(
        run.run_dir if run.is_main else None,
        total_steps=run.length.total_steps,
        first_step=run.step,
        first_tokens_seen=run.tokens_seen,
        log_every_steps=recipe.train.log_every_steps,
        say=say,
        show_bar=show_bar,
        record=trackers.log,
    )
    if run.step and run.is_main:  # resumed: the trackers' new runs get the history kept up to the checkpoint
        trackers.resend_history(run.run_dir / "metrics.jsonl")
    say(
        f"training {run.length.total_steps} steps ({run.length.micro_batches_per_epoch} micro-batches per epoch, "
        f"{recipe.train.grad_accum_steps} per step, {run.accelerator.num_processes} process(es))"
    )
    if run.data.validation is None and recipe.train.eval_every_steps:  # else the setting silently did nothing
        say(
            f"no held-out data (data.validation, data.validation_split): train.eval_every_steps="
            f"{recipe.train.eval_every_steps} evaluates nothing"
        )
    finishing = False
    with graceful_stop(say, lambda: finishing) as stop:
        try:
            last = run_steps(run, stop, fan_out(training_log, on_step))
            finishing = True
            _test_hook_slow_step()  # tests signal a run here, between its last step and its final evaluation
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


def _adapter_of_this_run(run: TrainingRun) -> bool:
    """Whether `adapters/<name>/` is what this run wrote at its last step: its recipe (less length and intervals),
    data and step are the checkpoint's. An adapter an earlier run left there (`output.overwrite` replaces it only
    once the new one is whole) is not: a run killed between its last checkpoint and its adapter finishes again."""
    adapter_dir = run.recipe.output.adapter_dir
    manifest = read_manifest(adapter_dir) if adapter_dir.is_dir() else None
    if manifest is None or manifest.recipe is None or manifest.data is None:
        return False
    recorded = {section: manifest.recipe.get(section, {}) for section in SECTIONS}
    return (
        manifest.metrics.get("step") == run.step
        and manifest.data.fingerprint == run.data.fingerprint
        and resume_mismatch(recorded, run.recipe) is None
    )


def _recorded_metrics(adapter_dir: Path) -> dict[str, Any]:
    manifest = read_manifest(adapter_dir)
    return dict(manifest.metrics) if manifest is not None else {}


def run_steps(run: TrainingRun, stop: StopRequest, on_step: StepCallback) -> dict[str, float]:
    """Optimizer steps until the run's length; returns the metrics of the last step and evaluation.

    Each step is queued without reading anything back (`device_step`); its metrics stay on the device until
    the loop reads them all at once (`PendingSteps.read`): at the logging interval, before an evaluation, a
    checkpoint or a stop, and at the end. Only then are `on_step` and the log called, once per step, in order.
    """
    train_config = run.recipe.train
    run.model_for_step.train()
    steps = PendingSteps(run, on_step, device_schedule(run))
    try:
        while run.step < run.length.total_steps:
            inputs = step_inputs(run, run.next_micro_batches())
            steps.add(device_step(run, inputs, steps.schedule), inputs.epoch)
            _test_hook_slow_step()
            is_final = run.step == run.length.total_steps
            evaluates = not is_final and train_config.eval_every_steps and run.step % train_config.eval_every_steps == 0
            saves = is_final or (train_config.save_every_steps and run.step % train_config.save_every_steps == 0)
            single_stop = run.accelerator.num_processes == 1 and stop.requested
            if is_final or evaluates or saves or single_stop or run.step % train_config.log_every_steps == 0:
                steps.fetch()  # the queued steps are done: what follows is not training time
                with steps.paused():
                    evaluation = run.evaluate() if evaluates else {}
                steps.read(evaluation)
                if saves:
                    with steps.paused():
                        run.save_checkpoint()
                if not is_final and stop_agreed(stop, run.accelerator):  # a collective: only where all read
                    # on a saving step its checkpoint was just written: a second write replaced it (the adapter,
                    # Adam's state, gathered again under FSDP/ZeRO), leaving it out of view while it did
                    path = checkpoint_path(run.run_dir, run.step) if saves else run.save_checkpoint()
                    raise TrainingInterrupted(
                        f"interrupted at step {run.step} of {run.length.total_steps}; checkpoint {path} written; run "
                        "the same `finetune train` command with --resume to continue",
                        stop.signal_number or 2,
                    )
    finally:
        if steps.schedule is not None:
            steps.schedule.close()
    return steps.last or run.last_metrics  # resumed from the last step's checkpoint: that step's, as recorded


class StepInputs(NamedTuple):
    """What the host prepares for one optimizer step: its micro-batches on the device, each unit's count over
    the step and the processes (on the device), the documents' tokens (this process; an objective that counts
    its own, `StepSums.tokens`, replaces them), and the epoch."""

    batches: list[dict[str, torch.Tensor]]
    counts: dict[str, torch.Tensor]
    tokens: int
    epoch: float


def step_inputs(run: TrainingRun, micro_batches: list[dict[str, torch.Tensor]]) -> StepInputs:
    """Count on the host, copy to the device (nothing here waits for the device); advance the run's position."""
    counts = _step_counts(run.objective, micro_batches, run.accelerator)
    batches = [to_device(batch, run.accelerator.device) for batch in micro_batches]
    tokens = run.advance(micro_batches)
    return StepInputs(batches, counts, tokens, run.stream.epoch_of(run.position))


class QueuedStep(NamedTuple):
    """One optimizer step's results, still on the device: `values` holds `names` in order (float64)."""

    step: int
    names: list[str]
    values: torch.Tensor
    elapsed_s: float


def device_step(run: TrainingRun, inputs: StepInputs, schedule: DeviceSchedule | None) -> QueuedStep:
    """Forward, backward, clip, optimizer and schedule step of one optimizer step, read nothing back (with a
    `schedule`; without one, the optimizer cannot skip on the device and the loss is read here)."""
    sums = step_sums(run.model_for_step, inputs, run.accelerator, run.sharding, run.objective, run.peft_model)
    max_norm = run.recipe.train.max_grad_norm or math.inf  # inf: measure the norm (for the NaN check), clip nothing
    grad_norm = torch.as_tensor(
        run.sharding.clip_grad_norm(run.accelerator, run.trainable_parameters, max_norm), device=sums.values.device
    )
    loss = sums.loss()
    # the rate this step trains at, read before the schedule advances (as the HF Trainer logs it): read after,
    # it was the next step's (warmup's first step logged lr/warmup where it trained at 0, the last logged 0)
    if schedule is not None:
        lr = schedule.lr()
        skipped = schedule.step(run.optimizer, loss, grad_norm)
    else:  # read on the host: bitsandbytes' optimizers, DeepSpeed, fp16
        lr = torch.tensor(run.scheduler.get_last_lr()[0])
        finite = math.isfinite(float(loss)) and math.isfinite(float(grad_norm))
        if finite:  # a skipped step changes nothing: not the weights, not Adam's state, not the schedule
            run.optimizer.step()
            run.scheduler.step()
        skipped = torch.tensor(0.0 if finite else 1.0)
    run.optimizer.zero_grad(set_to_none=True)
    device = sums.values.device
    local = sums.tokens if sums.tokens is not None else torch.tensor(inputs.tokens, dtype=torch.float64)
    tokens = run.accelerator.reduce(local.to(device, torch.float64), reduction="sum")
    extra = torch.stack([grad_norm.to(device, torch.float64), skipped.to(device, torch.float64),
                         lr.to(device, torch.float64), tokens])  # fmt: skip
    names = [*sums.names, *(f"count/{unit}" for unit in sums.count_units), "grad_norm", "skipped", "lr", "tokens"]
    values = torch.cat([sums.values, sums.counts, extra])
    return QueuedStep(run.step, names, values, time.perf_counter())


def device_schedule(run: TrainingRun) -> DeviceSchedule | None:
    """The on-device schedule where the optimizer can skip on the device (see `finetune.training.device_schedule`)."""
    if not DeviceSchedule.usable(run.optimizer, run.scheduler, run.recipe.train.precision, run.sharding.name):
        return None
    return DeviceSchedule(run.optimizer, run.scheduler, run.length.total_steps, run.accelerator.device)


class PendingSteps:
    """Steps queued on the device and not read yet; `read` reads them in one transfer and reports each.

    The steps' clock (`elapsed_s`, `step_s`, and so the log's `tokens_per_s`) leaves out the time `paused` for
    evaluations and checkpoints: with `eval_every_steps` equal to `log_every_steps`, every logged throughput
    had counted an evaluation (15x too low on a small run) and the report's "training throughput" with it.
    """

    def __init__(self, run: TrainingRun, on_step: StepCallback, schedule: DeviceSchedule | None) -> None:
        self.run, self.on_step, self.schedule = run, on_step, schedule
        self.queued: list[tuple[QueuedStep, float]] = []
        self.rows: list[list[float]] | None = None
        self.last: dict[str, float] = {}
        self.start_time = self.previous_end = time.perf_counter()
        self.paused_s = 0.0

    def add(self, step: QueuedStep, epoch: float) -> None:
        self.queued.append((step._replace(elapsed_s=step.elapsed_s - self.paused_s), epoch))

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in the block is not training time (call `fetch` first: the queued steps' work is)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - started

    def fetch(self) -> None:
        """Copy the queued steps' values to the host (one transfer, which waits for their work to finish)."""
        if self.queued and self.rows is None:
            self.rows = torch.stack([step.values for step, _ in self.queued]).tolist()

    def read(self, evaluation: dict[str, float]) -> None:
        """Read every queued step (one device-to-host copy), refuse a non-finite one beyond the allowed skips,
        and report each to `on_step`, the last with `evaluation`."""
        if not self.queued:
            return
        self.fetch()
        rows, self.rows = self.rows or [], None
        if self.schedule is not None:
            self.schedule.sync_host()
        run, objective = self.run, self.run.objective
        for number, ((step, epoch), row) in enumerate(zip(self.queued, rows)):
            value = dict(zip(step.names, row))
            counts = {unit: value[f"count/{unit}"] for unit in objective.count_units}
            reported = summarise(objective, value, counts)
            loss = reported.pop("loss")
            run.tokens_seen += int(value["tokens"])
            run.skipped_steps += int(value["skipped"])
            if value["skipped"]:
                _refuse_nonfinite(run, step.step, loss, value["grad_norm"], run.skipped_steps)
            metrics = {name: v for name, v in reported.items() if name != "ppl"}
            # this step's metrics only: one with no count this step (kto's chosen side in a step of undesirable
            # examples) is left out, not carried over from an earlier step as if measured again
            last = {**metrics, "loss": loss, "grad_norm": value["grad_norm"], "lr": value["lr"]}
            last.update(tokens_seen=run.tokens_seen, epoch=epoch)
            last.update(elapsed_s=step.elapsed_s - self.start_time, skipped_steps=run.skipped_steps)
            last.update(step_s=step.elapsed_s - self.previous_end)  # host seconds from the step before to this one
            self.previous_end = step.elapsed_s
            if number == len(self.queued) - 1:
                last.update(evaluation)
            self.on_step(step.step, last)
            self.last = {k: v for k, v in last.items() if not k.startswith("eval_")}  # the run's final one comes after
            run.last_metrics = self.last
        self.queued = []


def _test_hook_slow_step() -> None:
    """Tests sleep here (`FINETUNE_TEST_SECONDS_PER_STEP`), after each step and once more before the final
    evaluation, to signal a run at a known point; 0 by default."""
    seconds = float(os.environ.get(SLOW_STEP_ENV, "0") or 0)
    if seconds > 0:
        time.sleep(seconds)


def _refuse_nonfinite(run: TrainingRun, step: int, loss: float, grad_norm: float, skipped_steps: int) -> None:
    """Stop on a NaN/Inf step, unless the recipe allows skipping it (then nothing is updated)."""
    allowed = run.recipe.train.nonfinite_skips
    if skipped_steps <= allowed:
        return

    last_good = latest_checkpoint(run.run_dir)
    where = f"the last good checkpoint is {last_good}" if last_good else "no checkpoint was written yet"
    values = (("loss", loss), ("gradient norm", grad_norm))
    bad = [f"{name} {value}" for name, value in values if not math.isfinite(value)] or [f"{n} {v}" for n, v in values]
    raise TrainingError(
        f"step {step}: {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not finite (after {skipped_steps - 1} "
        f"allowed skips); no adapter was written; {where}; lower train.lr, use train.precision=fp32, or allow "
        "skips with train.nonfinite_skips"
    )


class StepLoss(NamedTuple):
    loss: float
    metrics: dict[str, float]
    """The objective's metrics over the step (means over their units, all processes): {} for SFT."""


class StepSums(NamedTuple):
    """One step's loss and metric sums over all processes, and each unit's count, on the device (float64)."""

    names: list[str]
    values: torch.Tensor
    count_units: tuple[str, ...]
    counts: torch.Tensor
    objective: Objective
    tokens: torch.Tensor | None = None
    """This process's tokens the step trained on, where the objective counts them itself (`trained_tokens`: GRPO's
    sampled sequences, unknown before the step); None: the documents' tokens the host counted (`StepInputs`)."""

    def loss(self) -> torch.Tensor:
        """Σ_u sum_u / N_u, a 0-d tensor on the device (what the backward took the gradient of)."""
        total = self.values.new_zeros(())
        for unit in self.objective.loss_units:
            total = total + self.values[self.names.index(f"loss/{unit}")] / self.counts[
                self.count_units.index(unit)].clamp(min=1)  # fmt: skip
        return total


def accumulate_gradients(
    model: Any,
    micro_batches: list[dict[str, torch.Tensor]],
    accelerator: Any,
    sharding: Sharding | None = None,
    objective: Objective | None = None,
    peft_model: Any = None,
) -> StepLoss:
    """Backward every micro-batch of one optimizer step; return the step's loss and metrics, read on the host.

    The loop itself uses `step_sums`, which reads nothing back; this is it plus one read.
    """
    objective = objective if objective is not None else BATCH_SFT
    counts = _step_counts(objective, micro_batches, accelerator)
    batches = [to_device(batch, accelerator.device) for batch in micro_batches]
    sums = step_sums(model, StepInputs(batches, counts, 0, 0.0), accelerator, sharding, objective, peft_model)
    values = torch.cat([sums.values, sums.counts]).tolist()  # one sync
    reported = summarise(
        objective, dict(zip(sums.names, values)), dict(zip(sums.count_units, values[len(sums.names) :]))
    )
    return StepLoss(reported.pop("loss"), {name: value for name, value in reported.items() if name != "ppl"})


def step_sums(
    model: Any,
    inputs: StepInputs,
    accelerator: Any,
    sharding: Sharding | None = None,
    objective: Objective | None = None,
    peft_model: Any = None,
) -> StepSums:
    """Backward every micro-batch of one optimizer step; return its sums, on the device.

    Each micro-batch's loss, summed over each normalisation unit of the objective (label tokens for SFT,
    the default), is divided by that unit's count over the whole step, summed over processes, and
    multiplied by the process count (DDP and FSDP average gradients over processes): the gradients are
    those of one batch holding everything, however it was split up. `peft_model` is `model` unwrapped
    (default: `model`), for the objective's no-grad passes.
    """
    sharding = sharding or DdpSharding()
    objective = objective if objective is not None else BATCH_SFT
    models = Models(model, model if peft_model is None else peft_model, accelerator)
    counts, batches = inputs.counts, inputs.batches
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
    unit_counts = torch.stack([counts[unit] for unit in objective.count_units])
    trained_tokens = getattr(objective, "trained_tokens", None)
    tokens = trained_tokens(prepared) if trained_tokens is not None else None
    return StepSums(names, totals, tuple(objective.count_units), unit_counts, objective, tokens)


def _step_counts(objective: Objective, micro_batches: list[dict[str, torch.Tensor]], accelerator: Any) -> dict:
    """Each unit's count over the step's micro-batches (counted on the host) and every process, as float64 on
    the device."""
    local = [0] * len(objective.count_units)
    for batch in micro_batches:
        batch_counts = objective.counts(batch)
        local = [total + batch_counts[unit] for total, unit in zip(local, objective.count_units)]
    reduced = accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=accelerator.device), reduction="sum")
    return dict(zip(objective.count_units, reduced))
