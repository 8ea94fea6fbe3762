"""SIGINT and SIGTERM as long-running commands take them: the first asks to stop, the second stops at once.

`finetune train` finishes its step and writes a checkpoint on the first signal; `finetune serve` finishes
loading and shuts down gracefully. Both only record the first signal in its handler and act on it in
their own code, so a signal never lands as an exception in the middle of a library (where a bare
`except:` could swallow it, or where it decides the exit status). A second signal gets the signal's
default action at once: whatever is written is written atomically, so nothing half-written is left
behind. The exit status is 128 + the signal either way.

Example:
    with first_signal_stops(announce=lambda name: print(f"{name}: stopping")) as stop:
        while not stop.requested:
            work()
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The first SIGINT/SIGTERM received while `first_signal_stops` was in force (None: none yet)."""

    def __init__(self) -> None:
        self.signal_number: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal_number is not None


@contextlib.contextmanager
def first_signal_stops(announce: Callable[[str], None]) -> Iterator[StopRequest]:
    """Handle SIGINT and SIGTERM as the module docstring says while the block runs, whatever the process
    inherited (SIGINT ignored in a shell's background job, say); restore the previous handlers after.

    `announce` gets the first signal's name (`SIGTERM`) from inside the handler: it must not take locks the
    interrupted code may hold (write with `os.write`, not `print`, where the main thread may be printing).
    Outside the main thread, where handlers cannot be set, nothing is installed.
    """
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handle(signal_number: int, frame: FrameType | None) -> None:
        if stop.requested:  # the second signal: the signal's default action, now
            signal.signal(signal_number, signal.SIG_DFL)
            os.kill(os.getpid(), signal_number)
            return
        stop.signal_number = signal_number
        announce(signal.Signals(signal_number).name)

    previous = {number: signal.signal(number, handle) for number in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
