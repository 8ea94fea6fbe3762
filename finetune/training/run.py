"""Everything a training run holds between steps, and how it is built: the `TrainingRun` state object.

`start_run` does the setup the loop needs, in order: an `Accelerator`, the base model and tokenizer,
the data, LoRA, the deterministic micro-batch stream and the length of the run, the optimizer and
schedule, and (with `resume`) the state of a checkpoint. The loop in `finetune.training.loop` then only steps;
evaluation and checkpointing are methods here because they read and write this state.

The seed is set after the base is loaded and the data is built, right before LoRA initialises its
weights: whatever loading consumes from the global RNG (building the embedded base, say) cannot change
what is trained, so the same recipe trains the same adapter whether or not the base was cached.

Example:
    run = start_run(load_recipe("recipes/quickstart.yaml"), resume=False, say=print)
    run.length.total_steps, run.step          # (150, 0)
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, gather_object, set_seed

from finetune.adapters.lora import CONFIG_NAME, PEFT_PREFIX
from finetune.adapters.resolved_base import ResolvedBase, resolve_base
from finetune.cpu_features import bf16_cpu_note
from finetune.data.collate import ROW_BUCKET, describe_layout
from finetune.data.packing import sequence_lengths
from finetune.data.pipeline import build_datasets
from finetune.data.sampler import MicroBatchStream
from finetune.errors import CheckpointError, RecipeError
from finetune.generation.lean_decoder import describe_generation
from finetune.model import (
    DTYPES,
    decoder_layers,
    describe_targets,
    describe_trainable,
    embedding_module_names,
    load_base_from_config,
    load_tokenizer_for,
    wrap_with_lora,
)
from finetune.plan.memory import describe_checkpointing
from finetune.quantization import Quantization
from finetune.recipe import EMBEDDING_LR_UNUSED, Recipe
from finetune.training import checkpoint as ckpt
from finetune.training.checkpointing import checkpointed_layer_count, enable_checkpointing
from finetune.training.deepspeed import DeepSpeedSharding, deepspeed_plugin, zero3_init_paused
from finetune.training.evaluate import evaluate
from finetune.training.fsdp import FsdpSharding
from finetune.training.lean_activations import use_lean_activations
from finetune.training.liger_kernels import use_liger_kernels
from finetune.training.mutated_start import mutates_base
from finetune.training.objectives import Objective, objective_for
from finetune.training.objectives.base import CarriesState, Models, describe_rewards
from finetune.training.objectives.grpo import GRPO
from finetune.training.objectives.reference import MeasuredAgainstStart, StartingWeights
from finetune.training.preference_setup import initial_adapter, precomputed_reference
from finetune.training.recipe_digest import recipe_digest, resume_mismatch
from finetune.training.regional_compile import compile_layers
from finetune.training.run_files import (
    adapter_taken,
    check_places_writable,
    check_process_count,
    checkpoint_path,
    checkpoint_step,
    earlier_run_error,
    earlier_run_files,
    resume_checkpoint,
    taken_adapter_error,
)
from finetune.training.sharding import (
    DdpSharding,
    DistributedInfo,
    Sharding,
    adapter_state,
    rank_param_share,
    trainable_names,
)
from finetune.training.tracking import log_with
from finetune.training.varlen_attention import choose_attention

Say = Callable[[str], None]


@dataclass(frozen=True)
class RunLength:
    """How long the run is, derived once from the data size and the recipe."""

    micro_batches_per_epoch: int
    total_steps: int
    warmup_steps: int
    total_micro_batches: int | None = None
    """The micro-batches a run set by `train.epochs` takes in all (None with `max_steps`: every step takes
    `grad_accum_steps`). Its last step takes only those left, as the HF Trainer's last accumulation does, so
    `epochs: 1` trains each document once, not a few of the next epoch's again."""

    def micro_batches_taken(self, grad_accum_steps: int) -> int:
        """The micro-batches the whole run takes from the stream (per process)."""
        return self.total_micro_batches or self.total_steps * grad_accum_steps


def run_length(recipe: Recipe, stream: MicroBatchStream) -> RunLength:
    train = recipe.train
    micro_batches = None
    if train.max_steps is not None:
        total = train.max_steps
    else:
        assert train.epochs is not None
        # rounded first: 0.3 epochs of 10 micro-batches is 3.0000000000000004 in floats, and 3 micro-batches
        micro_batches = max(1, math.ceil(round(train.epochs * stream.micro_batches_per_epoch, 6)))
        total = math.ceil(micro_batches / train.grad_accum_steps) * (train.num_iterations or 1)
    warmup = train.warmup_steps or math.ceil(train.warmup_ratio * total)  # rounded up, as the HF Trainer does
    # not cut to the run's length: a warmup of 10 steps in a run of 6 rises by lr/10 a step, as the Trainer's does
    # (cut to 6, it rose by lr/6 and trained at other rates than the recipe and the Trainer say)
    return RunLength(stream.micro_batches_per_epoch, total, warmup, micro_batches)


def parameter_groups(recipe: Recipe, peft_model: Any) -> list[dict[str, Any]]:
    """The trainable weights as optimizer groups: the blocks' LoRA at `train.lr`, the LoRA on the
    embeddings and head at `train.embedding_lr` (when they are trained and it is set).

    Raises:
        RecipeError: `train.embedding_lr` is set and no LoRA weights are on the embeddings or head.
    """
    embedding_names = embedding_module_names(peft_model.get_base_model())
    blocks: list[torch.nn.Parameter] = []
    embeddings: list[torch.nn.Parameter] = []
    for name, parameter in peft_model.named_parameters():
        if parameter.requires_grad:
            module = name.removeprefix(PEFT_PREFIX)
            on_embedding = any(module.startswith(embedding + ".") for embedding in embedding_names)
            (embeddings if on_embedding else blocks).append(parameter)
    if recipe.train.embedding_lr is not None and not embeddings:  # a list of targets naming neither
        raise RecipeError(EMBEDDING_LR_UNUSED)
    groups = [{"params": blocks, "lr": recipe.train.lr}]
    if embeddings:
        groups.append({"params": embeddings, "lr": recipe.train.embedding_lr or recipe.train.lr})
    if recipe.train.weight_decay:
        names = {id(parameter): name for name, parameter in peft_model.named_parameters()}
        groups = [part for group in groups for part in _split_by_decay(group, names)]
    return [group for group in groups if group["params"]]


_NOT_DECAYED = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
"""The HF Trainer's names of weights that `weight_decay` leaves alone (`Trainer.get_decay_parameter_names`):
biases and norms. A pretrained bias that `lora.bias: all` trains would otherwise be pulled towards 0 every step,
away from what the base learned."""


def _split_by_decay(group: dict[str, Any], names: dict[int, str]) -> list[dict[str, Any]]:
    """`group` as the weights `train.weight_decay` applies to, then the biases and norms, at weight decay 0."""
    exempt: list[torch.nn.Parameter] = []
    decayed: list[torch.nn.Parameter] = []
    for parameter in group["params"]:
        (exempt if _NOT_DECAYED.search(names[id(parameter)].lower()) else decayed).append(parameter)
    return [{**group, "params": decayed}, {**group, "params": exempt, "weight_decay": 0.0}]


def make_optimizer(recipe: Recipe, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    train = recipe.train
    kwargs: dict[str, Any] = dict(
        lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps, weight_decay=train.weight_decay
    )
    if train.optimizer == "adamw":
        # Fused: a handful of kernels for all tensors (a loop: several per tensor), and it can skip a non-finite
        # step on the device (`finetune.training.device_schedule`). On every device torch has it for (CPU too).
        devices = {p.device.type for group in groups for p in group["params"]}
        fused = devices <= {"cpu", "cuda", "xpu", "mps"}
        return torch.optim.AdamW(groups, **kwargs, fused=fused)
    import bitsandbytes as bnb  # only for the 8-bit optimizers: importing it is slow and chatty

    optimizer_class = bnb.optim.PagedAdamW8bit if train.optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
    return optimizer_class(groups, **kwargs)


def make_scheduler(recipe: Recipe, optimizer: torch.optim.Optimizer, length: RunLength) -> Any:
    # Imported here, after the model is wrapped: transformers' optimization module imports peft through its
    # trainer utilities, and a first import of peft there would load bitsandbytes (1.6 s) for every run.
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[recipe.train.schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=length.warmup_steps, num_training_steps=length.total_steps)


def check_output_free(recipe: Recipe) -> None:
    """The adapter directory is free, or `output.overwrite` may replace it: only an adapter (or an empty directory)
    is replaced, never another directory or a file that `output.dir` happens to name."""
    adapter_dir = recipe.output.adapter_dir
    if not adapter_taken(recipe):
        return
    if not recipe.output.overwrite:
        raise taken_adapter_error(recipe)
    if adapter_dir.is_symlink() or not adapter_dir.is_dir():
        raise RecipeError(f"output: {adapter_dir} is not a directory; output.overwrite replaces adapters only: "
                          "choose another output.dir")  # fmt: skip
    if any(adapter_dir.iterdir()) and not (adapter_dir / CONFIG_NAME).is_file():
        raise RecipeError(
            f"output: {adapter_dir} holds files but no adapter_config.json; output.overwrite replaces adapters only "
            "(it would delete that directory): choose another output.dir"
        )


@dataclass
class TrainingRun:
    """The state of one training run: what was built at setup, and where the loop is now."""

    recipe: Recipe
    accelerator: Any
    peft_model: Any
    """The LoRA-wrapped model, unwrapped: evaluation and saving use it (no recompiles under `compile`)."""
    model_for_step: Any
    """The same parameters as prepared for training (DDP-wrapped or sharded, maybe compiled): training uses it."""
    tokenizer: Any
    base: ResolvedBase
    """The base as resolved once at setup: what it is (source, fingerprint), how it is quantized, its device."""
    data: Any
    stream: MicroBatchStream
    length: RunLength
    optimizer: torch.optim.Optimizer
    scheduler: Any
    trainable_parameters: list[torch.nn.Parameter]
    sharding: Sharding
    distributed: DistributedInfo
    objective: Objective
    """What the run minimises (`train.objective`): its collation, loss and metrics."""
    row_tokens: list[int]
    """Tokens of each training row (both sequences of a pair), for `tokens_seen`."""
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    """Non-finite steps skipped so far (`train.nonfinite_skips` is a budget for the whole run, resumes included)."""
    position: int = 0
    """Micro-batches consumed so far (across epochs): all a checkpoint needs to resume the data."""
    base_eval: dict[str, float] = field(default_factory=dict)
    last_metrics: dict[str, float] = field(default_factory=dict)
    """The metrics of the last step read (checkpointed: a run resumed at its last step reports them)."""
    resumed_from: Path | None = None

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def run_dir(self) -> Path:
        return self.recipe.output.run_path

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return self.objective.collate(rows)

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps each step's data serves: grpo's `num_iterations` (trl repeats each batch μ times)."""
        return self.recipe.train.num_iterations or 1

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of the next optimizer step, for this process: `grad_accum_steps`, or those left of a
        run set by `train.epochs` (`RunLength.total_micro_batches`)."""
        accumulation = self.recipe.train.grad_accum_steps
        if self.length.total_micro_batches is not None:
            accumulation = min(accumulation, self.length.total_micro_batches - self.position)
        return [
            self.collate([self.data.train[i] for i in self.stream.indices(self.position + k)])
            for k in range(accumulation)
        ]

    def advance(self, micro_batches: list[dict[str, torch.Tensor]]) -> int:
        """Count one optimizer step over `micro_batches`; return their documents' tokens on this process (the
        loop sums them over the processes on the device and adds them to `tokens_seen` when it reads the step)."""
        positions = range(self.position, self.position + len(micro_batches))
        tokens = sum(self.row_tokens[i] for p in positions for i in self.stream.indices(p))
        self.step += 1
        if self.step % self.steps_per_batch == 0:
            self.position += len(micro_batches)
        return tokens

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and perplexity of the model as it is now; {} without validation data."""
        if self.data.validation is None:
            return {}
        return evaluate(
            self.peft_model,
            self.data.validation,
            collate=self.collate,
            micro_batch_size=self.recipe.train.micro_batch_size,
            accelerator=self.accelerator,
            max_batches=self.recipe.train.eval_max_batches,
            objective=self.objective,
        )

    def save_checkpoint(self) -> Path:
        """Write a resumable checkpoint of this step (every process takes part: RNG states and sharded
        weights and optimizer state are gathered, and the main process writes them whole)."""
        rng_states = gather_object([ckpt.capture_rng_state()])
        carried = self.objective.carried_state() if isinstance(self.objective, CarriesState) else None
        carried_states = gather_object([ckpt.cpu_copy(carried)])  # one entry per process, None or all lists
        trainable = adapter_state(self.peft_model, self.sharding.state.trainable_state(self.peft_model))
        optimizer = self.sharding.state.optimizer_state(self.optimizer)
        path = checkpoint_path(self.run_dir, self.step)
        if self.is_main:
            ckpt.save_checkpoint(
                self.run_dir,
                step=self.step,
                trainable=trainable,
                optimizer_state=optimizer,
                scheduler=self.scheduler,
                state={
                    "position": self.position,
                    "tokens_seen": self.tokens_seen,
                    "skipped_steps": self.skipped_steps,
                    "rng": rng_states,
                    "recipe_digest": recipe_digest(self.recipe),
                    "data_fingerprint": self.data.fingerprint,
                    "base_eval": self.base_eval,
                    "last_metrics": self.last_metrics,
                },
                keep=self.recipe.train.keep_checkpoints,
                carried=None if carried is None else carried_states,
            )
        self.accelerator.wait_for_everyone()
        return path


def _make_accelerator(recipe: Recipe, resumed_at: int = 0) -> Any:
    precision = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.train.precision]
    # accelerate keeps one process-wide AcceleratorState and refuses a second Accelerator with another
    # precision. Clearing it (not the PartialState holding the process group) lets the Python API run
    # several recipes in one process.
    AcceleratorState._reset_state(reset_partial_state=False)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if recipe.distributed.strategy != "deepspeed" or world_size == 1:
        return Accelerator(
            mixed_precision=precision, cpu=not torch.cuda.is_available(), log_with=log_with(recipe, resumed_at)
        )
    plugin = deepspeed_plugin(recipe, world_size)
    # Without CUDA accelerate picks no backend and counts 1 process although DeepSpeed joined all of them.
    handlers = [] if torch.cuda.is_available() else [InitProcessGroupKwargs(backend="gloo")]
    accelerator = Accelerator(
        mixed_precision=precision,
        deepspeed_plugin=plugin,
        log_with=log_with(recipe, resumed_at),
        kwargs_handlers=handlers,
    )
    if accelerator.distributed_type != DistributedType.DEEPSPEED or accelerator.num_processes != world_size:
        raise RecipeError(
            f"distributed.strategy deepspeed: accelerate started {accelerator.distributed_type.value} on "
            f"{accelerator.num_processes} of {world_size} processes instead (ACCELERATE_USE_CPU set?); launch with "
            "`finetune train --nproc N`, or unset ACCELERATE_USE_CPU"
        )
    return accelerator


def _wrap_for_training(recipe: Recipe, model: Any, checkpointed: int, say: Say) -> Any:
    model.config.use_cache = False  # packed rows are isolated by position ids only without the KV cache
    set_seed(recipe.train.seed)  # after loading: see the module docstring
    peft_model = wrap_with_lora(model, recipe.lora)
    enable_checkpointing(peft_model, checkpointed)
    if recipe.train.gradient_checkpointing is not False:
        setting, layers = recipe.train.gradient_checkpointing, len(decoder_layers(peft_model))
        say(describe_checkpointing(setting, checkpointed, layers))
    for line in describe_targets(peft_model):
        say(line)
    say(describe_trainable(peft_model))
    return peft_model


def _checkpointed_layers(recipe: Recipe, model: Any, device: torch.device, accelerator: Any) -> int:
    """`train.gradient_checkpointing` as a count of layers; `auto` plans the base's memory from a meta model of it,
    which must not be built under ZeRO-3's model init."""
    with zero3_init_paused(accelerator):
        return checkpointed_layer_count(recipe, model.config, device, accelerator.num_processes)


def _fit_to_device(recipe: Recipe, model: Any, device: torch.device, checkpointed: int, say: Say) -> tuple[bool, bool]:
    """What the device decides before LoRA wraps the base: a bf16-on-this-CPU note, whether the layers are
    compiled (not where any is `checkpointed`), Liger's kernels (else, unless compiled, the lean RMSNorm and
    MLP, `finetune.training.lean_activations`), and the attention. Returns (compiled, varlen attention)."""
    compiled = recipe.train.compiles(device.type, recipe.model.quantization != "none", checkpointing=checkpointed > 0)
    bf16_note = bf16_cpu_note(recipe.model.dtype, recipe.train.precision, device=device.type)
    if bf16_note is not None:
        say(bf16_note)
    if not use_liger_kernels(recipe.train.liger_kernels, model, device, say) and not compiled:
        use_lean_activations(model)
    return compiled, choose_attention(recipe.train.varlen_attention, model, device, say)


def start_run_dir_afresh(recipe: Recipe) -> None:
    """A fresh run (no --resume) must not mix with an earlier run's checkpoints and metrics in its run directory: a
    later --resume would continue the older run. They are deleted with `output.overwrite`, otherwise refused. The
    adapter directory is checked first (`check_output_free`)."""
    check_output_free(recipe)
    run_dir = recipe.output.run_path
    earlier = earlier_run_files(run_dir)
    if not earlier:
        return
    if not recipe.output.overwrite:
        raise earlier_run_error(run_dir)
    for path in earlier:  # every process may get here: another may have deleted it already
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def start_run(recipe: Recipe, *, resume: bool, say: Say) -> TrainingRun:
    """Build everything the loop needs; with `resume`, continue from the newest checkpoint."""
    recipe = recipe.for_device("cuda" if torch.cuda.is_available() else "cpu")
    check_places_writable(recipe)
    if not resume:
        start_run_dir_afresh(recipe)
    resume_from = resume_checkpoint(recipe.output.run_path) if resume else None
    accelerator = _make_accelerator(recipe, checkpoint_step(resume_from) if resume_from is not None else 0)
    if not accelerator.is_main_process:
        say = _silent
    with accelerator.main_process_first():  # the embedded base, its fingerprint and the data cache: built once
        base = _resolve_base(recipe, accelerator)
        tokenizer = load_tokenizer_for(recipe.model)
        data = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=say)
    # Every process at once: under ZeRO-3, transformers partitions the weights while loading (a collective).
    model, tokenizer, _ = load_base_from_config(recipe.model, tokenizer, device=base.device)
    say(f"base {recipe.model.base} ({base.source}, on {base.device}); data: {data.stats}")
    device = torch.device(base.device)
    checkpointed = _checkpointed_layers(recipe, model, device, accelerator)
    compiled, varlen = _fit_to_device(recipe, model, device, checkpointed, say)
    peft_model = _wrap_for_training(recipe, model, checkpointed, say)
    initial_adapter(recipe, peft_model, base, say)
    sharding = _shard(recipe, peft_model, accelerator)

    stream = MicroBatchStream(
        len(data.train), recipe.train.micro_batch_size, recipe.train.seed, accelerator.num_processes,
        accelerator.process_index,
    )  # fmt: skip
    length = run_length(recipe, stream)
    lengths = sequence_lengths(data.train)
    unit = {"preference": "pairs", "unpaired_preference": "examples", "prompt": "prompts"}.get(
        recipe.data.format, "documents"
    )
    say(describe_layout(lengths, stream, recipe.data.packing, unit=unit, bucket=ROW_BUCKET if varlen else 1))
    groups = parameter_groups(recipe, peft_model)
    trainable_parameters = [parameter for group in groups for parameter in group["params"]]
    optimizer = make_optimizer(recipe, groups)
    scheduler = make_scheduler(recipe, optimizer, length)
    model_for_step, optimizer = sharding.prepare(accelerator, peft_model, optimizer)
    distributed = _measure_distribution(sharding, peft_model, accelerator, say)  # ZeRO-3 partitions in prepare
    if compiled:
        compile_layers(peft_model, quantized=recipe.model.quantization != "none", say=say)
    objective = _objective(recipe, tokenizer, varlen, peft_model, length, say)
    models = Models(model_for_step, peft_model, accelerator)
    trained_rows = stream.rows_trained_on(length.micro_batches_taken(recipe.train.grad_accum_steps))
    data = precomputed_reference(
        recipe, objective, models, data, trained_rows=trained_rows, resume=resume_from is not None, say=say
    )
    run = TrainingRun(
        recipe, accelerator, peft_model, model_for_step, tokenizer, base, data, stream, length, optimizer,
        scheduler, trainable_parameters, sharding, distributed, objective, [sum(row) for row in lengths],
    )  # fmt: skip
    if resume_from is not None:
        _restore(run, resume_from, say)
    elif data.validation is not None:
        _evaluate_start(run, say)
    return run


def _objective(recipe: Recipe, tokenizer: Any, varlen: bool, peft_model: Any, length: RunLength, say: Say) -> Objective:
    """The recipe's objective. One measured against the model as the run starts (DPO, KTO, GRPO's KL) gets the
    starting trainable weights when disabling the adapter does not give that model (LoRA does not start as the
    base, or `lora.bias` trains the base's biases): copied here, before a resumed run loads its checkpoint's.
    GRPO learns the run's length (for its reward functions) and its log says how it will decode."""
    objective = objective_for(recipe, tokenizer, varlen)
    if isinstance(objective, MeasuredAgainstStart) and recipe.reference_swaps_start:
        objective.starting_weights = StartingWeights(peft_model)
    if isinstance(objective, GRPO):  # steps per epoch as `run_length` counts them (num_iterations per generation)
        per_epoch = length.micro_batches_per_epoch / recipe.train.grad_accum_steps * (recipe.train.num_iterations or 1)
        objective.set_run_length(length.total_steps, per_epoch)
        say(describe_generation(peft_model))
    return objective


def _evaluate_start(run: TrainingRun, say: Say) -> None:
    """The held-out metrics before training: the base's (adapter disabled) for SFT; for a preference objective
    the model's as it starts (the base, or `lora.init_from`'s adapter), against the reference."""
    if run.recipe.train.objective == "sft":
        # PiSSA/OLoRA moved part of the base into the adapter: the base is the model with it, as it starts
        with nullcontext() if mutates_base(run.recipe) else run.peft_model.disable_adapter():
            run.base_eval = run.evaluate()
        say(f"base model: eval loss {run.base_eval['eval_loss']:.4f}, perplexity {run.base_eval['eval_ppl']:.3f}")
        return
    run.base_eval = run.evaluate()
    if "eval_reward" in run.base_eval:  # an online objective (GRPO): the reward of sampled held-out completions
        say(f"at the start: held-out reward {run.base_eval['eval_reward']:.3f}")
        return
    say(f"at the start: eval loss {run.base_eval['eval_loss']:.4f}{describe_rewards(run.base_eval, prefix='eval_')}")


def _resolve_base(recipe: Recipe, accelerator: Any) -> ResolvedBase:
    """The recipe's base, loaded straight onto this process's device when one process holds it whole (one
    device, DDP); into host memory when FSDP or DeepSpeed shard it from there. A merged checkpoint is a
    base of its own here: the adapter is trained on the weights it holds."""
    shards = accelerator.num_processes > 1 and recipe.distributed.strategy != "ddp"
    base = resolve_base(
        recipe.model.base,
        quantization=Quantization.of(recipe.model),
        dtype=DTYPES[recipe.model.dtype],
        device="cpu" if shards else accelerator.device,
        revision=recipe.model.revision,
    )
    return base.as_own_base() if base.ledger.entries else base


def sharding_for(recipe: Recipe) -> Sharding:
    """The `Sharding` of the recipe's `distributed.strategy` (DeepSpeed runs through accelerate's plugin)."""
    strategy = recipe.distributed.strategy
    if strategy == "fsdp":
        return FsdpSharding(recipe.distributed, recipe.train.precision)
    if strategy == "deepspeed":
        return DeepSpeedSharding()
    return DdpSharding()


def _shard(recipe: Recipe, peft_model: Any, accelerator: Any) -> Sharding:
    """Shard the model over the processes as the recipe says, before the optimizer is built (it must
    hold the sharded parameters). One process has nothing to share."""
    if accelerator.num_processes == 1:
        return DdpSharding()
    sharding = sharding_for(recipe)
    sharding.shard(peft_model, accelerator)
    return sharding


def _measure_distribution(sharding: Sharding, peft_model: Any, accelerator: Any, say: Say) -> DistributedInfo:
    """What the manifest records: the strategy, the processes, and the largest share one of them holds."""
    if accelerator.num_processes == 1:
        return DistributedInfo("none", 1, 1.0)
    share = rank_param_share(sharding, peft_model, accelerator)
    say(f"{sharding.name} over {accelerator.num_processes} processes: each holds at most {share:.1%} of the parameters")
    return DistributedInfo(sharding.name, accelerator.num_processes, share)


def _restore(run: TrainingRun, path: Path, say: Say) -> None:
    trainable, optimizer, state = ckpt.load_checkpoint(path, scheduler=run.scheduler)
    mismatch = resume_mismatch(state.get("recipe_digest", {}), run.recipe)
    if mismatch is not None:
        raise CheckpointError(
            f"{path} was written by a different recipe: {mismatch}; resume with the original setting, "
            "or start fresh without --resume"
        )
    _check_resumable_here(run, path, state)
    if not optimizer["param_groups"]:  # a DeepSpeed run's, before finetune saved ZeRO's optimizer state
        raise CheckpointError(
            f"{path} holds no optimizer state (a distributed.strategy deepspeed run of an earlier finetune wrote "
            "it), so resuming would restart Adam's moments; start fresh without --resume"
        )
    rng_states = state["rng"]
    check_process_count(path, len(rng_states), run.accelerator.num_processes)
    try:
        trainable = trainable_names(run.peft_model, trainable)
    except KeyError as exc:
        raise CheckpointError(
            f"{path} holds weights this recipe does not train ({exc.args[0]}); resume with "
            "the original recipe, or start fresh without --resume"
        ) from None
    run.sharding.state.load_trainable_state(run.peft_model, trainable)
    run.sharding.state.load_optimizer_state(run.optimizer, optimizer)
    run.step, run.tokens_seen, run.position = state["step"], state["tokens_seen"], state["position"]
    run.skipped_steps = state.get("skipped_steps", 0)  # absent from checkpoints of finetune before it was recorded
    if hasattr(run.objective, "steps_prepared"):  # an online objective generates again on its own schedule
        run.objective.steps_prepared = run.step
    if state.get("carried") is not None and isinstance(run.objective, CarriesState):
        run.objective.restore_carried_state(state["carried"][run.accelerator.process_index], run.accelerator.device)
    run.base_eval = state.get("base_eval", {})
    run.last_metrics = state.get("last_metrics", {})
    run.resumed_from = path
    ckpt.restore_rng_state(rng_states[run.accelerator.process_index])
    say(f"resumed from {path} at step {run.step}")


def _check_resumable_here(run: TrainingRun, path: Path, state: dict[str, Any]) -> None:
    """The checkpoint's data are this run's (the same files, bytes and tokenizer: its position in them means the
    same), and it is not past this run's last step."""
    recorded = state.get("data_fingerprint")  # absent from checkpoints of finetune before it was recorded
    if recorded is not None and recorded != run.data.fingerprint:
        raise CheckpointError(
            f"{path} was written for other data ({recorded[:19]}..., now {run.data.fingerprint[:19]}...): the data "
            "files changed since; resume with the original data, or start fresh without --resume (lora.init_from "
            "continues from an adapter on new data)"
        )
    if state["step"] > run.length.total_steps:
        raise CheckpointError(
            f"{path} is at step {state['step']}, past this run's {run.length.total_steps} steps; resume with "
            f"train.max_steps of at least {state['step']} (or more epochs), or start fresh without --resume"
        )


def _silent(message: str) -> None:
    """Where the log lines of processes other than the main one go."""
