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

Checkpoints hold what a DDP or FSDP run's hold: every trainable weight and its Adam moments whole, as
torch's optimizer names them. ZeRO keeps its fp32 master weights and the moments in flat partitions of
its own layout (and DeepSpeed's own checkpoints are pickles); DeepSpeed's tensor-fragment API
(`deepspeed.utils.safe_get_full_*` / `safe_set_full_*`) maps each parameter to its pieces, so saving
gathers them whole and resuming scatters them back, under any strategy with the same number of processes.

Example:
    plugin = deepspeed_plugin(recipe, world_size=8)
    accelerator = Accelerator(mixed_precision="bf16", deepspeed_plugin=plugin)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from transformers.integrations import unset_hf_deepspeed_config

from finetune.recipe import Recipe
from finetune.training.sharding import GatheredState


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


@contextmanager
def zero3_init_paused(accelerator: Any) -> Iterator[None]:
    """transformers builds every model under `deepspeed.zero.Init` while a ZeRO-3 config is registered, which
    partitions it as it is made: a model built on the meta device only to count its parameters (`finetune plan`'s
    shape, for `gradient_checkpointing: auto`) then fails ("Cannot copy out of meta tensor"). The block runs with
    the config unregistered; accelerate's plugin registers it again after."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


class DeepSpeedSharding:
    """ZeRO: gradients and optimizer state (stage 2) and the parameters too (stage 3) partitioned over ranks."""

    name = "deepspeed"

    def __init__(self) -> None:
        self.state = ZeroState()

    def shard(self, model: Any, accelerator: Any) -> None:
        """Nothing to do before `prepare`: ZeRO-3 partitioned the weights while they loaded, and the engine
        `prepare` builds partitions the rest."""

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        self.state.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.state.group_sizes = [len(group["params"]) for group in optimizer.param_groups]
        self.state.engine, optimizer = accelerator.prepare(model, optimizer)
        return self.state.engine, optimizer

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]:
        self.state.engine.set_gradient_accumulation_boundary(sync)
        return nullcontext()

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        # The loss is already normalised over the whole step's tokens (see finetune.training.loop).
        self.state.engine.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        self.state.engine.step()  # clips to `gradient_clipping`, steps, zeroes the gradients
        norm = self.state.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")


class ZeroState:
    """`StateIO` for ZeRO: whole tensors gathered from (and scattered back into) DeepSpeed's partitions."""

    def __init__(self) -> None:
        self.engine: Any = None
        """Set by `DeepSpeedSharding.prepare`: the engine whose optimizer holds the partitions."""
        self.parameters: list[torch.nn.Parameter] = []
        """The trainable parameters in the order of torch's optimizer state dict (ZeRO's optimizer holds flat
        partitions instead)."""
        self.group_sizes: list[int] = []

    def trainable_state(self, model: Any) -> dict[str, torch.Tensor]:
        import deepspeed

        trainable = [p for p in model.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(trainable):  # whole on every rank (stage 3); a no-op otherwise
            return GatheredState().trainable_state(model)

    def load_trainable_state(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        """Into the weights the forward uses and into ZeRO's fp32 master copies, which the next step updates
        (separate tensors even in fp32)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param

        parameters = {name: p for name, p in model.named_parameters() if name in state}
        # Stage 3: gathered whole, and partitioned again from rank 0's copy on exit; a no-op otherwise.
        with deepspeed.zero.GatheredParameters(list(parameters.values()), modifier_rank=0), torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(state[name])
        for name, parameter in parameters.items():
            safe_set_full_fp32_param(parameter, state[name].to(parameter.device, torch.float32))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's state dict of the recipe's optimizer, as if it had held the parameters themselves."""
        from deepspeed.utils import safe_get_full_optimizer_state

        base = self._base_optimizer()
        flat_state: dict[str, Any] = next(
            (base.state[flat] for flat in self._flat_partitions() if flat in base.state), {}
        )
        per_element = sorted(key for key, value in flat_state.items() if _per_element(value))
        shared = {key: value for key, value in flat_state.items() if key not in per_element}  # Adam's `step`
        slots = {}
        for index, parameter in enumerate(self.parameters if flat_state else []):
            shape = getattr(parameter, "ds_shape", parameter.shape)  # ZeRO-3 leaves an empty placeholder
            slots[index] = {key: _copy(value) for key, value in shared.items()}
            for key in per_element:  # a collective: every rank gathers every tensor, in the same order
                slots[index][key] = safe_get_full_optimizer_state(parameter, key).reshape(shape).cpu()
        first = 0
        groups = []
        for size, group in zip(self.group_sizes, base.param_groups):
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(first, first + size))}
            )
            first += size
        return {"state": slots, "param_groups": groups}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        base = self._base_optimizer()
        for group, saved in zip(base.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})  # learning rate, betas, ...
        if not state["state"]:
            return  # saved before the first step: nothing to restore
        # The optimizer creates its state at its first step; a resumed run needs it now, shaped like ZeRO's
        # flat partitions, to receive each parameter's piece.
        template = next(iter(state["state"].values()))
        for flat in self._flat_partitions():
            base.state[flat] = {
                key: torch.zeros_like(flat) if _per_element(value) else _copy(value) for key, value in template.items()
            }
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # stages 1-2 point each parameter at its piece of that state after the first step
            link()
        for index, slot in state["state"].items():
            parameter = self.parameters[int(index)]
            for key, value in slot.items():
                if _per_element(value):
                    safe_set_full_optimizer_state(parameter, value.to(parameter.device), key)

    def _base_optimizer(self) -> torch.optim.Optimizer:
        """The recipe's torch optimizer inside ZeRO's, stepping ZeRO's flat fp32 partitions."""
        return self.engine.optimizer.optimizer

    def _flat_partitions(self) -> list[torch.Tensor]:
        """This rank's flat fp32 partitions, which the base optimizer's state is keyed by. Stage 3 puts them
        in its param groups only while it steps."""
        zero = self.engine.optimizer
        flats = getattr(zero, "fp32_partitioned_groups_flat", None)  # stage 3
        return list(flats if flats is not None else zero.single_partition_of_fp32_groups)  # stages 1-2

    def held_numel(self, parameter: torch.nn.Parameter) -> tuple[int, int]:
        partition = getattr(parameter, "ds_tensor", None)  # set by ZeRO-3: this rank's partition
        if partition is not None:
            return partition.numel(), int(parameter.ds_numel)  # type: ignore[attr-defined]  # set by ZeRO-3
        return parameter.numel(), parameter.numel()


def _per_element(value: Any) -> bool:
    """A state tensor with one entry per weight (Adam's moments), not one per tensor (its `step`)."""
    return torch.is_tensor(value) and value.dim() > 0


def _copy(value: Any) -> Any:
    return value.detach().clone().cpu() if torch.is_tensor(value) else value
