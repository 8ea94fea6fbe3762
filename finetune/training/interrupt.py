"""SIGINT and SIGTERM during training: finish the step, write a checkpoint, say how to resume.

A run is hours of GPU time, and schedulers (Slurm, Kubernetes) end jobs with SIGTERM. On the first
SIGINT or SIGTERM the loop finishes the optimizer step it is in, writes a checkpoint and stops with
`TrainingInterrupted`, whose message names the checkpoint and the command that resumes it. A second
signal ends the process at once (the default action of that signal): checkpoints and adapters are
written atomically, so even then nothing half-written is left where a reader would take it for whole.

With several processes every rank must stop at the same step (checkpointing is collective), so the
loop asks `stop_agreed`, which takes the maximum of the ranks' flags.

Example:
    with graceful_stop(say=print) as stop:
        while training:
            ...
            if stop.agreed(accelerator):
                save_checkpoint(); raise TrainingInterrupted(...)
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch

from finetune.errors import FinetuneError

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(FinetuneError):
    """Training stopped on SIGINT/SIGTERM after writing a checkpoint; the exit status is 128 + the signal."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signal_number


class StopRequest:
    """Set by the first SIGINT/SIGTERM; read by the loop at step boundaries."""

    def __init__(self) -> None:
        self.signal_number: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    def agreed(self, accelerator: Any) -> bool:
        """True on every process once any process was asked to stop (one tiny all-reduce with several)."""
        if accelerator.num_processes == 1:
            return self.requested

        flag = torch.tensor(float(self.signal_number or 0), device=accelerator.device)
        agreed = int(accelerator.reduce(flag, reduction="max"))
        if agreed and self.signal_number is None:
            self.signal_number = agreed
        return bool(agreed)


@contextlib.contextmanager
def graceful_stop(say: Callable[[str], None]) -> Iterator[StopRequest]:
    """Handle SIGINT/SIGTERM as described in the module docstring while the block runs."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield stop
        return

    def handle(signal_number: int, frame: FrameType | None) -> None:
        if stop.requested:  # the second signal: the signal's default action, now
            signal.signal(signal_number, signal.SIG_DFL)
            os.kill(os.getpid(), signal_number)
            return
        stop.signal_number = signal_number
        say(
            f"{signal.Signals(signal_number).name}: finishing this step and writing a checkpoint "
            "(send it again to stop at once)"
        )

    previous = {number: signal.signal(number, handle) for number in _SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
