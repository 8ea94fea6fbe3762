"""One training run's state: built from a recipe, advanced by the loop, saved to and resumed from checkpoints.

`start_run` does everything that happens before the first optimizer step (accelerator, base model and
LoRA, data, micro-batch stream, optimizer, schedule, resume) and returns a `TrainingRun`. The loop in
`finetune.train` advances its counters (`step`, `position`, `tokens_seen`); everything else in it is
fixed once built. Checkpoints hold the trainable weights, optimizer, scheduler, counters and RNG states,
so a resumed run continues bit for bit.

Example:
    run = start_run(load_recipe("recipes/quickstart.yaml"), resume=False, log=print)
    run.plan.total_steps                # 150
    micro_batches = run.next_micro_batches()
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import gather_object, set_seed
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import get_scheduler

from finetune import checkpoint as ckpt
from finetune.data import DataBundle, build_datasets, collate_batch
from finetune.data.sampler import MicroBatchStream
from finetune.errors import CheckpointError, RecipeError
from finetune.evaluate import evaluate
from finetune.model import describe_trainable, load_base_from_config, wrap_with_lora
from finetune.recipe import Recipe, recipe_to_dict

Log = Callable[[str], None]
Batch = dict[str, torch.Tensor]

# Settings that may change between a checkpoint and its resumption: how long to run and how often to report.
_RESUMABLE_TRAIN_KEYS = (
    "epochs",
    "max_steps",
    "log_every_steps",
    "eval_every_steps",
    "save_every_steps",
    "keep_checkpoints",
    "eval_max_batches",
)


def _silent(message: str) -> None:
    """The log of every process but the main one: one copy of each line per run."""


@dataclass(frozen=True)
class StepPlan:
    """How long the run is, derived once from the data size and the recipe."""

    micro_batches_per_epoch: int
    total_steps: int
    warmup_steps: int


def plan_steps(recipe: Recipe, stream: MicroBatchStream) -> StepPlan:
    """Total optimizer steps (`max_steps`, else whole epochs rounded up) and warm-up steps."""
    train = recipe.train
    if train.max_steps is not None:
        total = train.max_steps
    else:
        total = max(1, math.ceil(train.epochs * stream.micro_batches_per_epoch / train.grad_accum_steps))
    warmup = train.warmup_steps or int(train.warmup_ratio * total)
    return StepPlan(stream.micro_batches_per_epoch, total, min(warmup, total))


def recipe_digest(recipe: Recipe) -> dict[str, Any]:
    """The parts of a recipe a checkpoint must agree with to be resumed (length and intervals may change)."""
    resolved = recipe_to_dict(recipe)
    train = {k: v for k, v in resolved["train"].items() if k not in _RESUMABLE_TRAIN_KEYS}
    return {"model": resolved["model"], "lora": resolved["lora"], "data": resolved["data"], "train": train}


@dataclass
class TrainingRun:
    """Everything the training loop and the finishing steps need, built once by `start_run`.

    `peft_model` and `model_for_step` hold the same parameters: `model_for_step` (DDP-wrapped, maybe
    compiled) trains; evaluation and saving use `peft_model`, so a compiled model is not recompiled for the
    no-grad evaluation graphs.
    """

    recipe: Recipe
    accelerator: Accelerator
    say: Log
    peft_model: PeftModel
    model_for_step: torch.nn.Module
    base_source: str
    data: DataBundle
    collate: Callable[[list[dict]], Batch]
    stream: MicroBatchStream
    plan: StepPlan
    trainable_parameters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    position: int = 0
    """Micro-batches taken from the stream so far (per process), across epochs."""
    tokens_seen: int = 0
    """Non-padding tokens trained on so far, summed over processes."""
    base_eval: dict[str, float] = field(default_factory=dict)
    """Held-out metrics of the base model before training; {} without validation data."""
    resumed_from: Path | None = None

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def has_validation(self) -> bool:
        return self.data.validation is not None

    def next_micro_batches(self) -> list[Batch]:
        """This process's collated micro-batches of the next optimizer step (the counters are not advanced)."""
        accum_steps = self.recipe.train.grad_accum_steps
        return [
            self.collate([self.data.train[i] for i in self.stream.indices(self.position + k)])
            for k in range(accum_steps)
        ]

    def evaluate_validation(self) -> dict[str, float]:
        """Held-out `eval_loss`, `eval_ppl`, `eval_tokens` of the model as it is now; {} without validation data."""
        if self.data.validation is None:
            return {}
        return evaluate(
            self.peft_model,
            self.data.validation,
            collate=self.collate,
            micro_batch_size=self.recipe.train.micro_batch_size,
            accelerator=self.accelerator,
            max_batches=self.recipe.train.eval_max_batches,
        )

    def evaluate_base(self) -> dict[str, float]:
        """`evaluate_validation` with the adapter switched off: the baseline the adapter is measured against."""
        with self.peft_model.disable_adapter():
            return self.evaluate_validation()

    def save_checkpoint(self) -> None:
        """Write `checkpoint-<step>` into the run directory (main process; every process's RNG state)."""
        rng_states = gather_object([ckpt.capture_rng_state()])
        if self.is_main:
            ckpt.save_checkpoint(
                self.recipe.output.run_path,
                step=self.step,
                trainable=get_peft_model_state_dict(self.peft_model),
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                state={
                    "position": self.position,
                    "tokens_seen": self.tokens_seen,
                    "rng": rng_states,
                    "recipe_digest": recipe_digest(self.recipe),
                    "base_eval": self.base_eval,
                },
                keep=self.recipe.train.keep_checkpoints,
            )
        self.accelerator.wait_for_everyone()

    def restore(self, checkpoint_dir: Path) -> None:
        """Continue from `checkpoint_dir`: weights, optimizer, schedule, counters and this process's RNG."""
        trainable, state = ckpt.load_checkpoint(checkpoint_dir, optimizer=self.optimizer, scheduler=self.scheduler)
        if state.get("recipe_digest") != recipe_digest(self.recipe):
            raise CheckpointError(
                f"{checkpoint_dir} was written by a different recipe (model, lora, data or train settings differ); "
                "resume with the original recipe, or start fresh without --resume"
            )
        set_peft_model_state_dict(self.peft_model, trainable)
        self.step, self.tokens_seen, self.position = state["step"], state["tokens_seen"], state["position"]
        self.base_eval = state.get("base_eval", {})
        ckpt.restore_rng_state(state["rng"][self.accelerator.process_index])
        self.resumed_from = checkpoint_dir
        self.say(f"resumed from {checkpoint_dir} at step {self.step}")


def _checkpoint_to_resume(recipe: Recipe, resume: bool) -> Path | None:
    """The newest checkpoint when resuming; on a fresh run, check the adapter would not overwrite another."""
    run_dir = recipe.output.run_path
    if not resume:
        if recipe.output.adapter_dir.exists() and not recipe.output.overwrite:
            raise RecipeError(
                f"output: {recipe.output.adapter_dir} already exists; choose another output.name, "
                "or set output.overwrite=true"
            )
        return None
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is None:
        raise CheckpointError(f"--resume: no checkpoint in {run_dir}; run without --resume to start fresh")
    return latest


def _make_accelerator(recipe: Recipe) -> Accelerator:
    precision = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.train.precision]
    # accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator with another
    # precision. Clearing it (not the PartialState holding the process group) lets the Python API run
    # several recipes in one process.
    AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())


def make_optimizer(recipe: Recipe, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit (paged) AdamW, with the recipe's settings."""
    train = recipe.train
    kwargs = dict(
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, weight_decay=train.weight_decay
    )
    if train.optimizer == "adamw":
        return torch.optim.AdamW(parameters, **kwargs)
    import bitsandbytes as bnb  # optional dependency (the `quantization` extra): imported only when asked for

    optimizer_class = bnb.optim.PagedAdamW8bit if train.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return optimizer_class(parameters, **kwargs)


def make_scheduler(
    recipe: Recipe, optimizer: torch.optim.Optimizer, plan: StepPlan
) -> torch.optim.lr_scheduler.LRScheduler:
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[recipe.train.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=plan.warmup_steps, num_training_steps=plan.total_steps)


def _wrap_for_training(model: torch.nn.Module, recipe: Recipe) -> PeftModel:
    model.config.use_cache = False  # packed rows are isolated by position ids only without the KV cache
    peft_model = wrap_with_lora(model, recipe.lora)
    if recipe.train.gradient_checkpointing:
        peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return peft_model


def start_run(recipe: Recipe, *, resume: bool, log: Log) -> TrainingRun:
    """Build the run the recipe describes, resumed from the newest checkpoint when `resume`.

    Raises:
        RecipeError: the adapter directory exists and `output.overwrite` is off (fresh runs only).
        CheckpointError: `resume` without a checkpoint, or with one written by a different recipe.
    """
    resume_from = _checkpoint_to_resume(recipe, resume)
    accelerator = _make_accelerator(recipe)
    say = log if accelerator.is_main_process else _silent
    set_seed(recipe.train.seed)
    with accelerator.main_process_first():  # the embedded base and the data cache are built once
        model, tokenizer, base_source = load_base_from_config(recipe.model)
        data = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=say)
    say(f"base {recipe.model.base} ({base_source}); data: {data.stats}")
    peft_model = _wrap_for_training(model, recipe)
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
    optimizer = make_optimizer(recipe, trainable_parameters)
    scheduler = make_scheduler(recipe, optimizer, plan)
    model_for_step, optimizer = accelerator.prepare(peft_model, optimizer)
    if recipe.train.compile:
        model_for_step = torch.compile(model_for_step)
    # Varlen kernels want one padding-free sequence; sdpa/eager are faster on (B, T) packed rows.
    layout = "one_sequence" if recipe.model.attn_implementation == "flash_attention_2" else "rows"
    collate = partial(collate_batch, pad_token_id=tokenizer.pad_token_id, packing=recipe.data.packing, layout=layout)
    run = TrainingRun(
        recipe=recipe,
        accelerator=accelerator,
        say=say,
        peft_model=peft_model,
        model_for_step=model_for_step,
        base_source=base_source,
        data=data,
        collate=collate,
        stream=stream,
        plan=plan,
        trainable_parameters=trainable_parameters,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    if resume_from is not None:
        run.restore(resume_from)
    return run
