"""Apply a function to a stream of items in worker processes, results in input order, memory bounded.

Tokenizing is CPU work in Python and Rust that one process cannot spread over cores (the tokenizers
library's own threads parallelise the encoding alone, not the labels, splitting and Arrow conversion
around it), so data preparation hands chunks of records to one process per core. Three properties
matter and are why this is not `Pool.imap`:

- **Bounded.** At most `max_in_flight` items are read ahead; `imap` reads its whole input at once, and
  the input here is a corpus that may not fit in memory.
- **Ordered errors.** Results come back in input order, and an error reading the input is raised only
  after the results of the items before it, so the first bad record in file order is the one reported,
  as a one-line `DataError`, whichever process found it.
- **No pool for little work.** With one item (a small dataset, a test) or `num_proc=1`, everything runs
  in this process: no start-up cost, and monkeypatched functions stay visible.

Workers are forked where the platform offers it (Linux, as `datasets.map(num_proc=...)` does): they
start at once and share the parent's imported modules. The tokenizers library's threads would not
survive a fork, so workers run with `TOKENIZERS_PARALLELISM=false`, each encoding on its own core.
`state` (config and tokenizer) is handed to each worker once, when it starts; items and results are
pickled between our own processes only.

Example:
    for result in ordered_map(encode_chunk, chunks, state=(config, tokenizer), num_proc=4):
        writer.write(result)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from signal import SIG_DFL
from typing import Any, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

_worker_state: Any = None
"""The `state` of `ordered_map`, set once in each worker process by `_start_worker`."""


def default_num_proc() -> int:
    """Cores this process may run on (its CPU affinity, which containers and `taskset` narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def ordered_map(
    function: Callable[[Any, Item], Result],
    items: Iterable[Item],
    state: Any,
    num_proc: int,
    max_in_flight: int | None = None,
) -> Iterator[Result]:
    """`function(state, item)` for each item, in order, computed by `num_proc` processes.

    Args:
        function: a module-level function (workers find it by name).
        items: read lazily, at most `max_in_flight` ahead of the results taken.
        state: passed to every call; sent to each worker once.
        num_proc: worker processes; 1 computes everything in this process.
        max_in_flight: items handed out but not yet taken back; default 2 per worker, so no worker
            waits while the caller takes a result.

    Raises:
        Whatever `function` raises for the first failing item, or what reading `items` raises, whichever
        comes first in input order.
    """
    iterator = iter(items)
    first = next(iterator, _END)
    if first is _END:
        return
    second = next(iterator, _END) if num_proc > 1 else _END
    if second is _END:  # one item, or one process: no pool
        yield function(state, first)
        for item in iterator:
            yield function(state, item)
        return
    limit = max_in_flight or 2 * num_proc
    with _pool(num_proc, state) as pool:
        pending: deque = deque(pool.apply_async(_call, (function, item)) for item in (first, second))
        read_error: BaseException | None = None
        while pending:
            while read_error is None and len(pending) < limit:
                try:
                    item = next(iterator)
                except StopIteration:
                    break
                except Exception as exc:  # a malformed record: raised after the results before it
                    read_error = exc
                    break
                pending.append(pool.apply_async(_call, (function, item)))
            yield pending.popleft().get()
        if read_error is not None:
            raise read_error


_END: Any = object()


def _call(function: Callable[[Any, Any], Any], item: Any) -> Any:
    return function(_worker_state, item)


def _start_worker(state: Any) -> None:
    """Hold `state`. Ctrl-C (sent to the whole foreground group) is the parent's to act on: it terminates the
    pool, where each worker had printed a KeyboardInterrupt traceback of its own. SIGTERM is the pool's way of
    ending a worker, whatever handler the parent had when it forked."""
    global _worker_state
    _worker_state = state
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _workers_end_with_parent(pool: Any) -> Iterator[None]:
    """While the pool works, a SIGTERM to the parent alone (a supervisor's stop before training installs its own
    handler) SIGKILLs the workers and then ends the parent by SIGTERM, as it would have ended anyway. Left alone,
    the workers wrote their results into a pipe nobody read any more and each printed a BrokenPipeError traceback
    under the ended command. A handler the caller installed is kept, and nothing is installed off the main thread.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not SIG_DFL:
        yield
        return

    def end(signal_number: int, frame: Any) -> None:
        for process in list(getattr(pool, "_pool", [])):
            with contextlib.suppress(OSError, TypeError):
                os.kill(process.pid, signal.SIGKILL)
        signal.signal(signal_number, signal.SIG_DFL)
        os.kill(os.getpid(), signal_number)

    signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _pool(num_proc: int, state: Any) -> Iterator[Any]:
    """A pool of `num_proc` workers holding `state`; terminated on exit, also when the caller stops early."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # inherited by the workers; restored here at once
    try:
        pool = context.Pool(num_proc, initializer=_start_worker, initargs=(state,))
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        with _workers_end_with_parent(pool):
            yield pool
    finally:
        pool.terminate()
        pool.join()
