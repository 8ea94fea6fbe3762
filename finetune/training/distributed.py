"""How the processes of a run share the model: DDP (accelerate's wrapper) or FSDP2 (torch's `fully_shard`).

The training loop does not branch on the strategy; it asks a `Sharding` for what differs:

- `prepare`: DDP hands model and optimizer to `accelerator.prepare` (a `DistributedDataParallel`
  wrapper on several processes). FSDP shards each decoder layer and then the whole model with
  `fully_shard` *before* the optimizer is built (the optimizer must hold the sharded parameters) and
  prepares only the optimizer: accelerate's own FSDP plugin is silently ignored on CPU, where the run
  would quietly become DDP, and one code path for CPU and GPU is one that is tested here.
- `gradient_sync`: skip the gradient all-reduce / reduce-scatter on all but a step's last micro-batch.
- `backward`, `clip_grad_norm`: the global norm, also when gradients are sharded `DTensor`s.

- `trainable_state`, `optimizer_state`: whole (gathered) tensors for adapters and checkpoints, written by
  the main process and identical in names and shapes to a single-process run's. Every rank must call
  them, in the same order: they are collectives.
- `load_trainable_state`, `load_optimizer_state`: those whole tensors back into this run's parameters
  and optimizer, split as the strategy splits them. So a checkpoint does not depend on the strategy that
  wrote it (same world size: the data position and RNG states are per rank).

DeepSpeed ZeRO, driven by its own engine, is `finetune.training.deepspeed.DeepSpeedSharding`.

Example:
    sharding = sharding_for(recipe)
    sharding.shard(peft_model, accelerator)            # before building the optimizer
    model_for_step, optimizer = sharding.prepare(accelerator, peft_model, optimizer)
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from finetune.errors import ModelError
from finetune.model import decoder_layers
from finetune.recipe import DistributedConfig, Recipe


@dataclass(frozen=True)
class DistributedInfo:
    """What the manifest records about how a run was distributed."""

    strategy: str
    world_size: int
    max_rank_param_share: float
    """The largest share of the model's parameters (by count) one rank held between steps: about 1/N
    when sharded, 1.0 under DDP. Measured from the tensors each rank actually stores."""


class Sharding:
    """DDP: every rank holds the whole model; gradients are averaged by accelerate's DDP wrapper."""

    name = "ddp"

    def shard(self, model: Any, accelerator: Any) -> None:
        """Split the model over the ranks, in place (nothing to do under DDP)."""

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        return accelerator.prepare(model, optimizer)

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]:
        return nullcontext() if sync else accelerator.no_sync(model)

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        accelerator.backward(loss)

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        return float(accelerator.clip_grad_norm_(parameters, max_norm))

    def trainable_state(self, model: Any) -> dict[str, torch.Tensor]:
        """Every trainable parameter, whole, by its name in `model.state_dict()` (a collective when sharded)."""
        return {name: gathered(p.detach()).cpu() for name, p in model.named_parameters() if p.requires_grad}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with every sharded tensor gathered whole (a collective when sharded)."""
        state = optimizer.state_dict()
        slots = {
            index: {key: gathered(value).cpu() if torch.is_tensor(value) else value for key, value in slot.items()}
            for index, slot in state["state"].items()
        }
        return {**state, "state": slots}

    def load_trainable_state(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        """Copy whole tensors (as `trainable_state` gives them) into the parameters, sharded or not."""
        for name, parameter in model.named_parameters():
            if name in state:
                with torch.no_grad():
                    _local(parameter).copy_(_local(_shard_like(state[name], parameter)))

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a whole state dict (as `optimizer_state` gives it), sharding each tensor like its parameter."""
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        slots = {}
        for index, slot in state["state"].items():
            parameter = parameters[int(index)]
            slots[int(index)] = {
                key: _shard_like(value, parameter) if torch.is_tensor(value) and value.dim() > 0 else value
                for key, value in slot.items()
            }
        optimizer.load_state_dict({**state, "state": slots})

    def held_numel(self, parameter: torch.nn.Parameter) -> tuple[int, int]:
        """(elements this rank stores, elements of the whole parameter)."""
        return _local(parameter).numel(), parameter.numel()


class FsdpSharding(Sharding):
    """FSDP2: parameters, gradients and optimizer state are sharded (dim 0) over the ranks."""

    name = "fsdp"

    def __init__(self, config: DistributedConfig, precision: str):
        self.config = config.fsdp
        self.precision = precision

    def shard(self, model: Any, accelerator: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        options: dict[str, Any] = dict(
            mesh=mesh,
            reshard_after_forward=self.config.sharding == "full",
            mp_policy=_mixed_precision_policy(model, self.precision),
            offload_policy=CPUOffloadPolicy() if self.config.cpu_offload else OffloadPolicy(),
        )
        causal_lm = model.get_base_model()
        for layer in _decoder_layers(causal_lm):
            fully_shard(layer, **options)
        fully_shard(causal_lm, **options)  # the root unit: embeddings, final norm, head

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        return model, accelerator.prepare(optimizer)

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]:
        model.get_base_model().set_requires_gradient_sync(sync)
        return nullcontext()

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> float:
        accelerator.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def sharding_for(recipe: Recipe) -> Sharding:
    """The `Sharding` of the recipe's `distributed.strategy` (DeepSpeed runs through accelerate's plugin)."""
    strategy = recipe.distributed.strategy
    if strategy == "fsdp":
        return FsdpSharding(recipe.distributed, recipe.train.precision)
    if strategy == "deepspeed":
        from finetune.training.deepspeed import DeepSpeedSharding

        return DeepSpeedSharding()
    return Sharding()


def _decoder_layers(causal_lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The shard units: the model's decoder layers (`finetune.model.decoder_layers`)."""
    layers = decoder_layers(causal_lm)
    if not layers:
        raise ModelError(
            f"distributed.strategy fsdp: {type(causal_lm).__name__} names no decoder layer class "
            "(_no_split_modules); use strategy ddp for this model"
        )
    return layers


def _mixed_precision_policy(model: torch.nn.Module, precision: str) -> Any:
    """Compute in the autocast dtype and reduce gradients in float32; a base in 16 bits with float32
    LoRA weights (mixed dtypes in one shard unit, which FSDP2 refuses otherwise) computes in the base's dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    dtypes = {parameter.dtype for parameter in model.parameters()}
    if compute is None and len(dtypes) > 1:
        compute = next(dtype for dtype in dtypes if dtype != torch.float32)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a sharded `DTensor`; the tensor itself otherwise)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`whole` split over the ranks as `like` is (a `DTensor` for a sharded parameter)."""
    if not isinstance(like, DTensor):
        return whole.to(like.device)
    return distribute_tensor(whole.to(like.device_mesh.device_type), like.device_mesh, like.placements)


def rank_param_share(sharding: Sharding, model: torch.nn.Module, accelerator: Any) -> float:
    """The largest share of the model's parameters held by one rank (all ranks must call it)."""
    held, total = (sum(counts) for counts in zip(*(sharding.held_numel(p) for p in model.parameters())))
    share = torch.tensor(held / max(total, 1), dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(share, op=torch.distributed.ReduceOp.MAX)
    return float(share)


def adapter_state(peft_model: Any, trainable: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`trainable` (as `Sharding.trainable_state` gives it) named as in peft's adapter files."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, state_dict=trainable, save_embedding_layers=False)


def trainable_names(peft_model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights named as in peft's adapter files (as `adapter_state` gives them), renamed as in
    `state_dict()` (as `Sharding.load_trainable_state` takes them). KeyError names weights not trained here."""
    names = _adapter_names(peft_model)
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise KeyError(f"not trainable weights of this model: {unknown[:3]}")
    return {names[key]: tensor for key, tensor in state.items()}


def _adapter_names(peft_model: Any) -> dict[str, str]:
    """peft's adapter-file name -> `state_dict()` name, for every trainable weight. peft's own renaming is
    applied to index tensors and read back, so this follows peft exactly rather than imitating it."""
    from peft import get_peft_model_state_dict

    model_names = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    markers = {name: torch.tensor(index) for index, name in enumerate(model_names)}
    renamed = get_peft_model_state_dict(peft_model, state_dict=markers, save_embedding_layers=False)
    return {key: model_names[int(marker)] for key, marker in renamed.items()}
