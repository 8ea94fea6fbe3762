"""The training loop: recipe in, adapter directory out. Explicit code on `accelerate`.

The same loop runs on one CPU, one GPU, or many processes (DDP through `accelerate launch`). What
happens per optimizer step, in order:

1. take the next `grad_accum_steps` micro-batches of the deterministic stream (`finetune.data.sampler`);
2. count their label tokens and sum that count over processes: N;
3. for each micro-batch: loss = Σ token losses / N · num_processes, backward (gradients are only
   synchronised on the last one). DDP averages gradients over processes, hence the · num_processes:
   the result is exactly the gradient of the mean token loss over the whole global batch, however the
   tokens fall into micro-batches;
4. clip, step, schedule; log; evaluate and checkpoint on their intervals.

Example:
    result = train("recipes/quickstart.yaml", ["train.max_steps=20"])
    result.adapter_dir, result.metrics["eval_ppl"]
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from finetune import checkpoint as ckpt
from finetune.data.sampler import MicroBatchStream
from finetune.errors import CheckpointError, RecipeError
from finetune.evaluate import evaluate, forward_loss, to_device
from finetune.recipe import Recipe, load_recipe, recipe_to_dict

Log = Callable[[str], None]


def _stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class TrainResult(tuple):
    """`(adapter_dir, metrics)`; unpacks like a tuple, with named fields too."""

    def __new__(cls, adapter_dir: Path, metrics: dict[str, Any]):
        return super().__new__(cls, (adapter_dir, metrics))

    @property
    def adapter_dir(self) -> Path:
        return self[0]

    @property
    def metrics(self) -> dict[str, Any]:
        return self[1]


@dataclass
class _Plan:
    """How long the run is, derived once from the data size and the recipe."""

    micro_batches_per_epoch: int
    total_steps: int
    warmup_steps: int


def plan_steps(recipe: Recipe, stream: MicroBatchStream) -> _Plan:
    train = recipe.train
    if train.max_steps is not None:
        total = train.max_steps
    else:
        total = max(1, math.ceil(train.epochs * stream.micro_batches_per_epoch / train.grad_accum_steps))
    warmup = train.warmup_steps or int(train.warmup_ratio * total)
    return _Plan(stream.micro_batches_per_epoch, total, min(warmup, total))


def _make_optimizer(recipe: Recipe, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    train = recipe.train
    kwargs = dict(
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, weight_decay=train.weight_decay
    )
    if train.optimizer == "adamw":
        return torch.optim.AdamW(parameters, **kwargs)
    import bitsandbytes as bnb

    optimizer_class = bnb.optim.PagedAdamW8bit if train.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return optimizer_class(parameters, **kwargs)


def _make_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer, plan: _Plan):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[recipe.train.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=plan.warmup_steps, num_training_steps=plan.total_steps)


def _check_output_free(recipe: Recipe) -> None:
    adapter_dir = recipe.output.adapter_dir
    if adapter_dir.exists() and not recipe.output.overwrite:
        raise RecipeError(
            f"output: {adapter_dir} already exists; choose another output.name, or set output.overwrite=true"
        )


def _recipe_digest(recipe: Recipe) -> dict[str, Any]:
    """The parts of a recipe a checkpoint must agree with to be resumed (length and intervals may change)."""
    resolved = recipe_to_dict(recipe)
    train = {
        k: v
        for k, v in resolved["train"].items()
        if k
        not in (
            "epochs",
            "max_steps",
            "log_every_steps",
            "eval_every_steps",
            "save_every_steps",
            "keep_checkpoints",
            "eval_max_batches",
        )
    }
    return {"model": resolved["model"], "lora": resolved["lora"], "data": resolved["data"], "train": train}


@dataclass
class _MetricsWriter:
    """metrics.jsonl + TensorBoard in the run directory (main process only)."""

    run_dir: Path
    enabled: bool
    _tensorboard: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def write(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")
        for key, value in values.items():
            self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()


def _real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a collated batch that are not padding (padding-free batches have none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())


def _format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def accumulate_gradients(model, micro_batches: list[dict[str, torch.Tensor]], accelerator) -> float:
    """Backward every micro-batch of one optimizer step; return the step's mean token loss.

    Each micro-batch's summed token loss is divided by the label tokens of the whole step, summed over
    processes, and multiplied by the process count (DDP averages gradients over processes): the
    gradients are those of one batch holding every token, however the tokens were split up.
    """
    local_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
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


def _write_adapter_atomically(peft_model, recipe: Recipe, manifest, final_dir: Path) -> None:
    """Save the adapter into a hidden temp dir beside `final_dir`, then rename it into place."""
    from finetune.manifest import write_manifest

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(tmp, safe_serialization=True)
    import yaml

    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False))
    write_manifest(tmp, manifest)
    if final_dir.exists():
        trash = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
        final_dir.rename(trash)
        tmp.rename(final_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final_dir)


def train(
    recipe_or_path: Recipe | str | Path,
    overrides: Sequence[str] = (),
    *,
    resume: bool = False,
    log: Log = _stderr_log,
    progress: bool | None = None,
) -> TrainResult:
    """Fine-tune a LoRA adapter as the recipe says; return (adapter directory, final metrics).

    Args:
        recipe_or_path: a `Recipe` or the path of a YAML recipe.
        overrides: `key=value` strings applied on top (validated like the file).
        resume: continue from the newest checkpoint in the run directory (error if there is none).
        log: where progress lines go (stderr by default).
        progress: show a progress bar; default: when stderr is a terminal.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import gather_object, set_seed

    from finetune.api import local_model_dir
    from finetune.data import build_datasets, collate_batch
    from finetune.fingerprint import fingerprint_model_dir
    from finetune.manifest import BaseInfo, DataInfo, Manifest, library_versions, now_iso
    from finetune.model import describe_trainable, load_base_from_config, wrap_with_lora

    recipe = load_recipe(recipe_or_path, list(overrides))
    if not resume:
        _check_output_free(recipe)
    run_dir = recipe.output.run_path
    resume_from = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume and resume_from is None:
        raise CheckpointError(f"--resume: no checkpoint in {run_dir}; run without --resume to start fresh")

    precision = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.train.precision]
    # accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator with another
    # precision. Clearing it (not the PartialState holding the process group) lets the Python API run
    # several recipes in one process.
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())
    is_main = accelerator.is_main_process
    say: Log = log if is_main else (lambda message: None)
    set_seed(recipe.train.seed)

    with accelerator.main_process_first():  # the embedded base and the data cache are built once
        model, tokenizer, base_source = load_base_from_config(recipe.model)
        data = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=say)
    say(f"base {recipe.model.base} ({base_source}); data: {data.stats}")

    model.config.use_cache = False  # packed rows are isolated by position ids only without the KV cache
    peft_model = wrap_with_lora(model, recipe.lora)
    if recipe.train.gradient_checkpointing:
        peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    say(describe_trainable(peft_model))

    stream = MicroBatchStream(
        num_rows=len(data.train),
        micro_batch_size=recipe.train.micro_batch_size,
        seed=recipe.train.seed,
        num_processes=accelerator.num_processes,
        process_index=accelerator.process_index,
    )
    plan = plan_steps(recipe, stream)
    trainable_parameters = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = _make_optimizer(recipe, trainable_parameters)
    scheduler = _make_scheduler(recipe, optimizer, plan)
    # `model_for_step` (DDP-wrapped, maybe compiled) trains; evaluation and saving use `peft_model`, the
    # same parameters unwrapped, so a compiled model is not recompiled for the no-grad eval graphs.
    model_for_step, optimizer = accelerator.prepare(peft_model, optimizer)
    if recipe.train.compile:
        model_for_step = torch.compile(model_for_step)

    # Varlen kernels want one padding-free sequence; sdpa/eager are faster on (B, T) packed rows.
    layout = "one_sequence" if recipe.model.attn_implementation == "flash_attention_2" else "rows"

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        return collate_batch(rows, pad_token_id=tokenizer.pad_token_id, packing=recipe.data.packing, layout=layout)

    def evaluate_validation() -> dict[str, float]:
        return evaluate(
            peft_model,
            data.validation,
            collate=collate,
            micro_batch_size=recipe.train.micro_batch_size,
            accelerator=accelerator,
            max_batches=recipe.train.eval_max_batches,
        )

    def run_eval(step: int) -> dict[str, float]:
        if data.validation is None:
            return {}
        result = evaluate_validation()
        metrics_writer.write(step, result)
        say(f"step {step}: eval loss {result['eval_loss']:.4f}, perplexity {result['eval_ppl']:.3f}")
        return result

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    digest = _recipe_digest(recipe)
    step, tokens_seen, position = 0, 0, 0
    base_eval: dict[str, float] = {}
    if resume_from is not None:
        trainable, state = ckpt.load_checkpoint(resume_from, optimizer=optimizer, scheduler=scheduler)
        if state.get("recipe_digest") != digest:
            raise CheckpointError(
                f"{resume_from} was written by a different recipe (model, lora, data or train settings differ); "
                "resume with the original recipe, or start fresh without --resume"
            )
        set_peft_model_state_dict(peft_model, trainable)
        step, tokens_seen, position = state["step"], state["tokens_seen"], state["position"]
        base_eval = state.get("base_eval", {})
        ckpt.restore_rng_state(state["rng"][accelerator.process_index])
        say(f"resumed from {resume_from} at step {step}")

    metrics_writer = _MetricsWriter(run_dir, enabled=is_main)
    if resume_from is None and data.validation is not None:
        with peft_model.disable_adapter():
            base_eval = evaluate_validation()
        say(f"base model: eval loss {base_eval['eval_loss']:.4f}, perplexity {base_eval['eval_ppl']:.3f}")

    def save(step_now: int) -> None:
        rng_states = gather_object([ckpt.capture_rng_state()])
        if is_main:
            ckpt.save_checkpoint(
                run_dir,
                step=step_now,
                trainable=get_peft_model_state_dict(peft_model),
                optimizer=optimizer,
                scheduler=scheduler,
                state={
                    "position": position,
                    "tokens_seen": tokens_seen,
                    "rng": rng_states,
                    "recipe_digest": digest,
                    "base_eval": base_eval,
                },
                keep=recipe.train.keep_checkpoints,
            )
        accelerator.wait_for_everyone()

    from tqdm.auto import tqdm

    show_bar = is_main and (sys.stderr.isatty() if progress is None else progress)
    bar = tqdm(total=plan.total_steps, initial=step, disable=not show_bar, unit="step", dynamic_ncols=True)
    say(
        f"training {plan.total_steps} steps ({plan.micro_batches_per_epoch} micro-batches per epoch, "
        f"{recipe.train.grad_accum_steps} per step, {accelerator.num_processes} process(es))"
    )
    model_for_step.train()
    last_log_time, last_log_tokens = time.perf_counter(), tokens_seen
    loop_start, loop_start_step = last_log_time, step
    train_metrics: dict[str, float] = {}
    eval_metrics: dict[str, float] = {}
    while step < plan.total_steps:
        micro_batches = [
            collate([data.train[i] for i in stream.indices(position + k)]) for k in range(recipe.train.grad_accum_steps)
        ]
        mean_loss = accumulate_gradients(model_for_step, micro_batches, accelerator)
        grad_norm = None
        if recipe.train.max_grad_norm is not None:
            grad_norm = accelerator.clip_grad_norm_(trainable_parameters, recipe.train.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        position += recipe.train.grad_accum_steps
        tokens_seen += sum(_real_tokens(b) for b in micro_batches) * accelerator.num_processes
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.4f}", refresh=False)
        if step % recipe.train.log_every_steps == 0 or step == plan.total_steps:
            now = time.perf_counter()
            tokens_per_s = (tokens_seen - last_log_tokens) / max(now - last_log_time, 1e-9)
            last_log_time, last_log_tokens = now, tokens_seen
            train_metrics = {
                "loss": mean_loss,
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_per_s,
                "epoch": stream.epoch_of(position),
                "tokens_seen": tokens_seen,
            }
            if grad_norm is not None:
                train_metrics["grad_norm"] = float(grad_norm)
            metrics_writer.write(step, train_metrics)
            bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            if not show_bar:
                seconds_per_step = (now - loop_start) / (step - loop_start_step)
                eta = _format_seconds(seconds_per_step * (plan.total_steps - step))
                say(
                    f"step {step}/{plan.total_steps}: loss {mean_loss:.4f}, lr {train_metrics['lr']:.3g}, "
                    f"{tokens_per_s:,.0f} tokens/s, ETA {eta}"
                )
        is_final = step == plan.total_steps
        if recipe.train.eval_every_steps and step % recipe.train.eval_every_steps == 0 and not is_final:
            eval_metrics = run_eval(step)
        if (recipe.train.save_every_steps and step % recipe.train.save_every_steps == 0) or is_final:
            save(step)
    bar.close()

    eval_metrics = run_eval(step) or eval_metrics
    metrics = {"step": step, "tokens_seen": tokens_seen, **train_metrics, **eval_metrics}
    if base_eval:
        metrics["base_eval_loss"], metrics["base_eval_ppl"] = base_eval["eval_loss"], base_eval["eval_ppl"]
    if base_eval and eval_metrics:
        cut = 1 - eval_metrics["eval_ppl"] / base_eval["eval_ppl"]
        metrics["ppl_cut"] = cut
        say(
            f"held-out perplexity: base {base_eval['eval_ppl']:.3f} -> base + adapter {eval_metrics['eval_ppl']:.3f} "
            f"({100 * cut:.1f}% lower)"
        )

    adapter_dir = recipe.output.adapter_dir
    if is_main:
        base_dir = local_model_dir(base_source, recipe.model.revision)  # a hub id: its local snapshot
        manifest = Manifest(
            name=recipe.output.name,
            base=BaseInfo(
                id=recipe.model.base,
                path=base_source,
                revision=recipe.model.revision,
                fingerprint=fingerprint_model_dir(base_dir) if base_dir is not None else "unknown",
                dtype=recipe.model.dtype,
                quantization=recipe.model.quantization,
            ),
            recipe=recipe_to_dict(recipe),
            data=DataInfo(fingerprint=data.fingerprint, sources=[s.path for s in recipe.data.train], stats=data.stats),
            metrics=metrics,
            versions=library_versions(),
            created=now_iso(),
        )
        _write_adapter_atomically(peft_model, recipe, manifest, adapter_dir)
        say(f"adapter written to {adapter_dir}")
    metrics_writer.close()
    accelerator.wait_for_everyone()
    return TrainResult(adapter_dir, metrics)
