"""SIGINT and SIGTERM during training: finish the step, write a checkpoint, say how to resume.

A run is hours of GPU time, and schedulers (Slurm, Kubernetes) end jobs with SIGTERM. On the first
SIGINT or SIGTERM the loop finishes the optimizer step it is in, writes a checkpoint and stops with
`TrainingInterrupted`, whose message names the checkpoint and the command that resumes it. A second
signal ends the process at once (the default action of that signal): checkpoints and adapters are
written atomically, so even then nothing half-written is left where a reader would take it for whole.

With several processes every rank must stop at the same step (checkpointing is collective), so the
loop asks `stop_agreed`, which takes the maximum of the ranks' flags. The signal handling itself is
`finetune.signals`, shared with `finetune serve`.

Example:
    with graceful_stop(say=print) as stop:
        while training:
            ...
            if stop_agreed(stop, accelerator):
                save_checkpoint(); raise TrainingInterrupted(...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from finetune.errors import FinetuneError
from finetune.signals import StopRequest, first_signal_stops


class TrainingInterrupted(FinetuneError):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint; the exit status is 128 + the signal."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signal_number


def stop_agreed(stop: StopRequest, accelerator: Any) -> bool:
    """True on every process once any process was asked to stop (one tiny all-reduce with several)."""
    if accelerator.num_processes == 1:
        return stop.requested
    flag = torch.tensor(float(stop.signal_number or 0), device=accelerator.device)
    agreed = int(accelerator.reduce(flag, reduction="max"))
    if agreed and stop.signal_number is None:
        stop.signal_number = agreed
    return bool(agreed)


@contextlib.contextmanager
def graceful_stop(say: Callable[[str], None], finishing: Callable[[], bool] = lambda: False) -> Iterator[StopRequest]:
    """Handle SIGINT/SIGTERM as described in the module docstring while the block runs. Once `finishing()` is
    true (the steps are done: the final evaluation and the adapter are what is left), a first signal lets that
    finish (the run then ends as a whole one) rather than end the process without a word or a hint."""

    def announce(name: str) -> None:
        if finishing():
            say(f"{name}: the steps are done; finishing the final evaluation and writing the adapter (send it again "
                "to stop at once, then --resume finishes the run)")  # fmt: skip
        else:
            say(f"{name}: finishing this step and writing a checkpoint (send it again to stop at once)")

    with first_signal_stops(announce) as stop:
        yield stop
