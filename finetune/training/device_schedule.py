"""The optimizer step without the host: non-finite steps skipped and the learning-rate schedule kept on the device.

A training loop that checks `math.isfinite(loss)` and steps a Python scheduler reads the loss on the host
every step, so on a GPU the host waits for the whole forward and backward before it queues the next step.
Here that decision stays on the device:

- `found_inf` = the step's loss or gradient norm is not finite (a 0-d tensor). Fused AdamW reads it (its
  `found_inf` attribute, the mechanism `torch.amp.GradScaler` uses) and leaves the weights, the moments and
  the step counters untouched where it is 1: a skipped step changes nothing, bit for bit.
- The schedule is a table of every step's learning rate per parameter group, computed once from the
  transformers scheduler's own lambdas, on the device. `applied`, the count of steps actually taken (a 0-d
  int64), picks each step's rate (`index_select`) into the groups' `lr`, 0-d float32 tensors that fused AdamW
  reads (its CUDA kernel takes no other dtype: "expected scalar type Float but found Double" on an H100): a
  skipped step does not advance the schedule, as if it had not happened. The rate reported is the table's.
- `sync_host` writes `applied` back into the scheduler (its `last_epoch` and last rates) when the loop reads
  its metrics anyway (logging, evaluation, checkpoint): the checkpoint format does not change.

Where this cannot work (an optimizer without `found_inf`: bitsandbytes' 8-bit AdamW; DeepSpeed, whose engine
steps; fp16, whose GradScaler owns `found_inf`), `DeviceSchedule.usable` says so and the loop checks on the
host every step, as before.

Example:
    schedule = DeviceSchedule(optimizer, scheduler, total_steps=150, device=device)
    skipped = schedule.step(optimizer, loss, grad_norm)     # 0-d float tensor, 1.0 where the step was skipped
    schedule.sync_host()                                    # before a checkpoint
"""

from __future__ import annotations

from typing import Any

import torch


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside accelerate's `AcceleratedOptimizer` (or `optimizer` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def takes_found_inf(optimizer: Any) -> bool:
    """Whether `optimizer` skips a step on the device: a fused torch Adam/AdamW."""
    inner = inner_optimizer(optimizer)
    return isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and bool(inner.defaults.get("fused"))


class DeviceSchedule:
    """A scheduler's learning rates as a device table, stepped by the count of steps taken (see module docstring)."""

    def __init__(self, optimizer: Any, scheduler: Any, total_steps: int, device: torch.device) -> None:
        self.optimizer, self.scheduler = inner_optimizer(optimizer), scheduler
        rates = [
            [float(base) * lambda_(step) for step in range(total_steps + 1)]
            for base, lambda_ in zip(scheduler.base_lrs, scheduler.lr_lambdas)
        ]
        self.table = torch.tensor(rates, dtype=torch.float64, device=device)  # (groups, steps + 1)
        self.applied = torch.tensor(scheduler.last_epoch, dtype=torch.int64, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.taken = self.table[0, scheduler.last_epoch].clone()  # the first group's rate, as `lr()` reports it
        for index, group in enumerate(self.optimizer.param_groups):
            group["lr"] = self.table[index, scheduler.last_epoch].to(torch.float32)  # its own tensor
        self.optimizer.found_inf = self.found_inf

    @staticmethod
    def usable(optimizer: Any, scheduler: Any, precision: str, sharding_name: str) -> bool:
        return (
            takes_found_inf(optimizer)
            and hasattr(scheduler, "lr_lambdas")
            and precision != "fp16"
            and sharding_name != "deepspeed"
        )

    def step(self, optimizer: Any, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Step the optimizer unless `loss` or `grad_norm` is not finite; advance the schedule if it stepped.
        Returns the 0-d float32 `found_inf` of this step (a copy)."""
        bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).to(torch.float32)
        self.found_inf.copy_(bad)
        optimizer.step()
        self.applied.add_(1 - bad.to(torch.int64))
        position = self.applied.view(1)
        for index, group in enumerate(self.optimizer.param_groups):
            group["lr"].copy_(self.table[index].index_select(0, position).squeeze(0))
        self.taken = self.table[0].index_select(0, position).squeeze(0)
        return bad

    def lr(self) -> torch.Tensor:
        """The first group's learning rate the next `step` trains at, as the host scheduler's `get_last_lr`
        reports it (0-d float64 on the device: the table's value, not the float32 the optimizer reads). A new
        tensor after each `step`, never changed in place: read before a step, it stays that step's rate."""
        return self.taken

    def sync_host(self) -> None:
        """Write the steps taken into the host scheduler (a read of one device scalar)."""
        applied = int(self.applied)
        self.scheduler.last_epoch = applied
        self.scheduler._step_count = applied + 1
        self.scheduler._last_lr = [float(rate) for rate in self.table[:, applied].tolist()]

    def close(self) -> None:
        """Give the optimizer back plain float rates and no `found_inf` (after the loop, and before it is saved
        by code that expects floats)."""
        self.sync_host()
        for group, rate in zip(self.optimizer.param_groups, self.scheduler._last_lr):
            group["lr"] = rate
        if getattr(self.optimizer, "found_inf", None) is self.found_inf:
            del self.optimizer.found_inf
