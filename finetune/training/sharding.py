"""How the processes of a run share the model: the `Sharding` interface, DDP, and what every strategy shares.

The training loop does not branch on the strategy; it asks its `Sharding` for what differs:

- `shard`: split the model over the ranks, before the optimizer is built (it must hold the sharded
  parameters); `prepare`: hand model and optimizer to accelerate (or DeepSpeed's engine).
- `gradient_sync`: skip the gradient all-reduce / reduce-scatter on all but a step's last micro-batch.
- `backward`, `clip_grad_norm`: the global norm, also when gradients are sharded `DTensor`s.
- `state.trainable_state`, `state.optimizer_state`: whole (gathered) tensors for adapters and checkpoints, written by
  the main process and identical in names and shapes to a single-process run's. Every rank must call
  them, in the same order: they are collectives.
- `state.load_trainable_state`, `state.load_optimizer_state`: those whole tensors back into this run's parameters
  and optimizer, split as the strategy splits them. So a checkpoint does not depend on the strategy that
  wrote it (same world size: the data position and RNG states are per rank).

Three strategies implement it side by side, without implementation inheritance: `DdpSharding` here
(every rank holds the whole model; accelerate's DDP wrapper averages gradients), `FsdpSharding` in
`finetune.training.fsdp` (torch's FSDP2) and `DeepSpeedSharding` in `finetune.training.deepspeed`
(ZeRO). The checkpoint side of each (`StateIO`) is a part it holds: DDP and FSDP hold the same `GatheredState`.

Example:
    sharding = DdpSharding()
    sharding.shard(peft_model, accelerator)            # before building the optimizer
    model_for_step, optimizer = sharding.prepare(accelerator, peft_model, optimizer)
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from finetune.peft_import import import_peft


@dataclass(frozen=True)
class DistributedInfo:
    """What the manifest records about how a run was distributed."""

    strategy: str
    world_size: int
    max_rank_param_share: float
    """The largest share of the model's parameters (by count) one rank held between steps: about 1/N
    when sharded, 1.0 under DDP. Measured from the tensors each rank actually stores."""


class StateIO(Protocol):
    """Reads and writes a run's trainable weights and optimizer state as whole tensors (see the module docstring)."""

    def trainable_state(self, model: Any) -> dict[str, torch.Tensor]: ...

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load_trainable_state(self, model: Any, state: dict[str, torch.Tensor]) -> None: ...

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None: ...

    def held_numel(self, parameter: torch.nn.Parameter) -> tuple[int, int]:
        """(elements this rank stores, elements of the whole parameter)."""
        ...


class Sharding(Protocol):
    """What the training loop asks of a strategy (see the module docstring); `state` is its `StateIO`."""

    name: str

    @property
    def state(self) -> StateIO: ...

    def shard(self, model: Any, accelerator: Any) -> None: ...

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]: ...

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]: ...

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None: ...

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> Any:
        """The gradients' global norm before clipping: a 0-d tensor on the device, or a float."""


class DdpSharding:
    """DDP: every rank holds the whole model; gradients are averaged by accelerate's DDP wrapper. One
    process is the same with nothing to average."""

    name = "ddp"

    def __init__(self) -> None:
        self.state: StateIO = GatheredState()

    def shard(self, model: Any, accelerator: Any) -> None:
        """Nothing to split: every rank holds the whole model."""

    def prepare(self, accelerator: Any, model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
        return accelerator.prepare(model, optimizer)

    def gradient_sync(self, accelerator: Any, model: Any, sync: bool) -> AbstractContextManager[Any]:
        return nullcontext() if sync else accelerator.no_sync(model)

    def backward(self, accelerator: Any, loss: torch.Tensor) -> None:
        accelerator.backward(loss)

    def clip_grad_norm(self, accelerator: Any, parameters: list[torch.nn.Parameter], max_norm: float) -> Any:
        return accelerator.clip_grad_norm_(parameters, max_norm)  # a tensor on the device: nothing waits for it


class GatheredState:
    """`StateIO` for DDP and FSDP: parameters are plain tensors or `DTensor` shards, gathered whole on the way
    out and split like each parameter on the way in, so a checkpoint does not depend on the strategy."""

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
        """(elements this rank stores: a `DTensor`'s local shard, elements of the whole parameter)."""
        return _local(parameter).numel(), parameter.numel()


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


def lockstep_batches(
    num_rows: int, micro_batch_size: int, rank: int, processes: int, max_batches: int | None = None
) -> list[tuple[list[int], bool]]:
    """This process's strided share of `num_rows` rows in micro-batches, as (row indices, counted) pairs.

    Every process gets the same number of batches, because a sharded model's forward is a collective that
    a rank with nothing left to run would hang: a process whose share ran out repeats row 0, not counted
    (its outputs are discarded). Each row is counted by exactly one process.

    `max_batches` keeps the rows of the first `max_batches` micro-batches of one process, shared out as the others
    are: the same rows and so the same figures on any number of processes (taken per process, N ranks evaluated N
    times the rows one process did, and other held-out figures).
    """
    if max_batches is not None:
        num_rows = min(num_rows, max_batches * micro_batch_size)
    indices = list(range(rank, num_rows, processes))
    batches = [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    most = math.ceil(math.ceil(num_rows / processes) / micro_batch_size)
    return [(batches[n], True) if n < len(batches) else ([0], False) for n in range(most)]


def rank_param_share(sharding: Sharding, model: torch.nn.Module, accelerator: Any) -> float:
    """The largest share of the model's parameters held by one rank (all ranks must call it)."""
    held, total = (sum(counts) for counts in zip(*(sharding.state.held_numel(p) for p in model.parameters())))
    share = torch.tensor(held / max(total, 1), dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        torch.distributed.all_reduce(share, op=torch.distributed.ReduceOp.MAX)
    return float(share)


def adapter_state(peft_model: Any, trainable: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`trainable` (as `StateIO.trainable_state` gives it) named as in peft's adapter files."""
    return import_peft().get_peft_model_state_dict(peft_model, state_dict=trainable, save_embedding_layers=False)


def trainable_names(peft_model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights named as in peft's adapter files (as `adapter_state` gives them), renamed as in
    `state_dict()` (as `StateIO.load_trainable_state` takes them). KeyError names weights not trained here."""
    names = _adapter_names(peft_model)
    unknown = sorted(set(state) - set(names))
    if unknown:
        raise KeyError(f"not trainable weights of this model: {unknown[:3]}")
    return {names[key]: tensor for key, tensor in state.items()}


def _adapter_names(peft_model: Any) -> dict[str, str]:
    """peft's adapter-file name -> `state_dict()` name, for every trainable weight. peft's own renaming is
    applied to index tensors and read back, so this follows peft exactly rather than imitating it."""
    model_names = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    markers = {name: torch.tensor(index) for index, name in enumerate(model_names)}
    renamed = import_peft().get_peft_model_state_dict(peft_model, state_dict=markers, save_embedding_layers=False)
    return {key: model_names[int(marker)] for key, marker in renamed.items()}
