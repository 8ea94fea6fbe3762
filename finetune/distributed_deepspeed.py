"""`distributed.strategy: deepspeed`: DeepSpeed ZeRO stage 2 or 3, through accelerate's DeepSpeed plugin.

The config is built from the recipe (`deepspeed_config`), so a run has one source of truth: micro-batch,
accumulation, clipping and precision come from `train`, the ZeRO stage and offloads from
`distributed.deepspeed`. DeepSpeed's engine owns the step: it clips (`gradient_clipping`), steps and
zeroes the gradients in `engine.step()`, so `DeepSpeedSharding.clip_grad_norm` takes that step and
returns the norm the engine measured; the optimizer's `step` that follows in the loop is accelerate's
no-op for DeepSpeed. The learning-rate schedule still drives the optimizer's param groups, which ZeRO's
optimizer shares.

Runs on CPU too (DeepSpeed falls back to gloo without oneCCL), as long as `ACCELERATE_USE_CPU` is not
set: accelerate then ignores the plugin and the run would quietly be DDP, which `make_accelerator` refuses.

Not offered yet: resuming a DeepSpeed run (its optimizer state is partitioned in ZeRO's own layout),
which is refused in one line; checkpoints still hold the whole trained weights.

Example:
    plugin = deepspeed_plugin(recipe, world_size=8)
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from finetune.distributed import Sharding
from finetune.recipe import Recipe


def deepspeed_config(recipe: Recipe, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of `recipe` on `world_size` processes (the JSON DeepSpeed's own parser reads)."""
    train, options = recipe.train, recipe.distributed.deepspeed
    zero: dict[str, Any] = {
        "stage": options.stage,
        "offload_optimizer": {"device": "cpu" if options.offload_optimizer else "none"},
    }
    if options.stage == 3:
        zero["offload_param"] = {"device": "cpu" if options.offload_params else "none"}
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps,
        "train_batch_size": train.micro_batch_size * train.grad_accum_steps * world_size,
        "gradient_clipping": train.max_grad_norm or 0.0,  # 0: off
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16"},
        # The recipe's optimizer (torch AdamW) also with offloaded state, rather than DeepSpeed's compiled CPU Adam.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # progress is ours to report
        "wall_clock_breakdown": False,
    }


def deepspeed_plugin(recipe: Recipe, world_size: int) -> Any:
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=deepspeed_config(recipe, world_size))


class DeepSpeedSharding(Sharding):
    """ZeRO: gradients and optimizer state (stage 2) and the parameters too (stage 3) partitioned over ranks."""

    name = "deepspeed"

    def __init__(self) -> None:
        self.engine: Any = None

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        self.engine, optimizer = accelerator.prepare(model, optimizer)
        return self.engine, optimizer

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]:
        self.engine.set_gradient_accumulation_boundary(sync)
        return nullcontext()

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        # The loss is already normalised over the whole step's tokens (see finetune.train).
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        self.engine.step()  # clips to `gradient_clipping`, steps, zeroes the gradients
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def trainable_state(self, model: Any) -> dict[str, torch.Tensor]:
        import deepspeed

        trainable = [p for p in model.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(trainable):  # whole on every rank (stage 3); a no-op otherwise
            return super().trainable_state(model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}  # resuming a DeepSpeed run is refused (module docstring)

    def held_numel(self, parameter: torch.nn.Parameter) -> tuple[int, int]:
        partition = getattr(parameter, "ds_tensor", None)  # set by ZeRO-3: this rank's partition
        if partition is not None:
            return partition.numel(), int(parameter.ds_numel)  # type: ignore[attr-defined]  # set by ZeRO-3
        return parameter.numel(), parameter.numel()
