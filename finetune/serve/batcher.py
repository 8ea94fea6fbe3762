"""The scheduler of `finetune serve`: one worker thread runs every forward, rows of many requests per forward.

Requests become `Sequence`s (one per prompt) in a queue. The worker loop, one round at a time:
1. runs the runtime adapter operations (`control`) that can run now: a load at once, an unload once
   no running row uses that adapter, a merged-mode swap once nothing runs;
2. admits queued sequences up to `max_batch_size` rows; an idle server first waits up to `max_wait_ms`
   for more to arrive. Admitted prompts run in one prefill forward (left-padded, each row with its
   own adapter) and join the running batch (`KVBatch.join`);
3. runs one decode step for every running row, whatever its model; finished rows leave the batch.
So requests join and leave between steps (iteration-level batching) and a long request does not hold
up a short one. Greedy rows give the tokens they would alone: padding is masked, positions are per row.

Results go back through each sequence's `emit` callback (called on the worker thread): `Piece`s of text
when streaming, then `Finished` or `Failed`. A forward that raises fails the rows in it (500) and the
worker carries on: one bad request never stops the server.

Example:
    batcher = Batcher(engine, max_batch_size=8, max_wait_ms=10, max_pending=64); batcher.start()
    batcher.submit([Sequence("legal", ids, max_new_tokens=16, sampling=SamplingParams(0.0), emit=print)])
    batcher.stop()
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from finetune.errors import ServeError
from finetune.generation.kvbatch import KVBatch
from finetune.serve.engine import Engine
from finetune.serve.sampling import SamplingParams, make_generator, next_tokens
from finetune.serve.textstream import TextStream

logger = logging.getLogger("finetune.serve")


@dataclass(frozen=True)
class Piece:
    """New text of sequence `index` (streaming only)."""

    index: int
    text: str


@dataclass(frozen=True)
class Finished:
    """Sequence `index` is done: its whole text, why it stopped ("stop" | "length"), its tokens."""

    index: int
    text: str
    finish_reason: str
    prompt_token_ids: list[int]
    token_ids: list[int]


@dataclass(frozen=True)
class Failed:
    """Sequence `index` failed with `error`."""

    index: int
    error: ServeError


Event = Piece | Finished | Failed


@dataclass(eq=False)
class Sequence:
    """One prompt to continue: what the request asked for, and the worker's progress on it."""

    model: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    emit: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()
    """Tokens that end this sequence besides the engine's `stop_token_ids` (a chat reply's end of turn, an adapter's
    own EOS: `Engine.stop_ids`)."""
    index: int = 0
    stream: bool = False
    cancelled: bool = False  # set by the request handler when its client went away
    arrived: float = field(default_factory=time.monotonic)
    generated: list[int] = field(default_factory=list)
    text: TextStream | None = None
    generator: torch.Generator | None = None

    @property
    def decoded(self) -> TextStream:
        """`text`, which the worker sets when it admits the sequence (before its prefill)."""
        assert self.text is not None, "the sequence was not admitted"
        return self.text


@dataclass(eq=False)
class _Control:
    """A runtime adapter operation, run on the worker thread between steps."""

    action: Callable[[], str]
    blocks: Callable[[str], bool]  # model -> do not admit sequences of it while this waits
    ready: Callable[[list[str]], bool]  # running rows' models -> can it run now
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class BatchStats:
    """Counters of forward passes, for /stats and the tests that prove requests were batched together."""

    def __init__(self):
        self._lock = threading.Lock()
        self.forward_passes = self.prefill_passes = self.rows_total = self.max_rows = 0
        self.forwards_by_model_count: Counter[int] = Counter()  # distinct models in one forward -> passes
        self.sequences_finished = self.sequences_failed = 0
        self.joins = 0  # prefills whose rows joined a batch already decoding

    def record_forward(self, models: list[str], *, prefill: bool) -> None:
        with self._lock:
            self.forward_passes += 1
            self.prefill_passes += prefill
            self.rows_total += len(models)
            self.max_rows = max(self.max_rows, len(models))
            self.forwards_by_model_count[len(set(models))] += 1

    def record_join(self) -> None:
        with self._lock:
            self.joins += 1

    def count(self, *, failed: bool) -> None:
        with self._lock:
            if failed:
                self.sequences_failed += 1
            else:
                self.sequences_finished += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "forward_passes": self.forward_passes,
                "prefill_passes": self.prefill_passes,
                "decode_steps": self.forward_passes - self.prefill_passes,
                "rows_total": self.rows_total,
                "max_rows_per_forward": self.max_rows,
                "forwards_by_model_count": {str(k): v for k, v in sorted(self.forwards_by_model_count.items())},
                "joins": self.joins,
                "sequences_finished": self.sequences_finished,
                "sequences_failed": self.sequences_failed,
            }


class Batcher:
    """Queue + worker thread over an `Engine`; see the module docstring for one round of its loop."""

    def __init__(self, engine: Engine, *, max_batch_size: int, max_wait_ms: float, max_pending: int):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.max_pending = max_pending
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: deque[Sequence] = deque()
        self._controls: list[_Control] = []
        self._running: list[Sequence] = []  # row i of self._batch
        self._batch: KVBatch | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="finetune-serve-worker", daemon=True)

    # ---- called from request handlers --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the current step, then fail everything still queued or running (503)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        error = ServeError("the server is shutting down", status=503, error_type="server_error", code="shutting_down")
        with self._cond:
            leftovers, self._queue = [*self._queue, *self._running], deque()
            controls, self._controls = self._controls, []
        for sequence in leftovers:
            self._fail(sequence, error)
        for control in controls:
            control.future.set_exception(error)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue the sequences of one request; ServeError (429) when that would pass `max_pending`."""
        with self._cond:
            if self._stopping:
                raise ServeError("the server is shutting down", status=503, error_type="server_error")
            if len(sequences) > self.max_pending:  # a 429 would have the client retry what can never fit
                raise ServeError(
                    f"prompt: {len(sequences)} prompts in one request, more than --max-pending {self.max_pending} "
                    "sequences in flight; send them in smaller requests",
                    param="prompt",
                )
            pending = len(self._queue) + len(self._running)
            if pending + len(sequences) > self.max_pending:
                raise ServeError(
                    f"too many requests in flight ({pending} sequences queued or running, limit {self.max_pending} "
                    "set by --max-pending); retry later",
                    status=429,
                    error_type="rate_limit_error",
                    code="too_many_pending",
                )
            self._queue.extend(sequences)
            self._cond.notify_all()

    def control(
        self,
        action: Callable[[], str],
        *,
        blocks: Callable[[str], bool] = lambda model: False,
        ready: Callable[[list[str]], bool] = lambda running: True,
    ) -> concurrent.futures.Future:
        """Run `action` on the worker thread as soon as `ready(models of running rows)`; its result or error
        lands in the returned future. Queued sequences for which `blocks(model)` wait until it has run."""
        control = _Control(action, blocks, ready)
        with self._cond:
            if self._stopping:
                raise ServeError("the server is shutting down", status=503, error_type="server_error")
            self._controls.append(control)
            self._cond.notify_all()
        return control.future

    def load(self) -> dict:
        """Queued and running sequences now."""
        with self._cond:
            return {"queued": len(self._queue), "running": len(self._running)}

    # ---- the worker thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while self._next_round():
            try:
                self._run_controls()
                self._admit()
                if self._running:
                    self._step()
            except Exception:  # a bug, not a bad request: fail what runs, keep serving
                logger.exception("finetune serve: a scheduling round failed")
                self._fail_running()

    def _next_round(self) -> bool:
        """Wait until there is work (and, when idle, up to max_wait for a fuller batch); False: stop."""
        with self._cond:
            while not (self._stopping or self._running or self._queue or self._controls):
                self._cond.wait()
            if not self._running and self._queue and not self._controls:
                deadline = self._queue[0].arrived + self.max_wait_s
                while not self._stopping and len(self._queue) < self.max_batch_size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            return not self._stopping

    def _run_controls(self) -> None:
        """Run waiting controls in order, up to the first that cannot run yet."""
        while True:
            with self._cond:
                models = [sequence.model for sequence in self._running]
                if not self._controls or not self._controls[0].ready(models):
                    return
                control = self._controls.pop(0)
            try:
                control.future.set_result(control.action())
            except Exception as exc:
                control.future.set_exception(exc)

    def _admit(self) -> None:
        free = self.max_batch_size - len(self._running)
        taken: list[Sequence] = []
        with self._cond:
            waiting: deque[Sequence] = deque()
            for sequence in self._queue:
                if sequence.cancelled:
                    continue
                if len(taken) < free and not any(control.blocks(sequence.model) for control in self._controls):
                    taken.append(sequence)
                else:
                    waiting.append(sequence)
            self._queue = waiting
        admitted = []
        for sequence in taken:
            try:
                self.engine.check_model(sequence.model)  # it may have been unloaded or swapped out while queued
                admitted.append(sequence)
            except ServeError as exc:
                self._fail(sequence, exc)
        if admitted:
            self._prefill(admitted)

    def _prefill(self, sequences: list[Sequence]) -> None:
        """Run the prompts of newly admitted sequences in one forward; those that go on join the batch."""
        try:
            prompts, models = [s.prompt_ids for s in sequences], [s.model for s in sequences]
            batch = KVBatch.from_prompts(prompts, models, self._pad_id, self.engine.device)
            for sequence in sequences:
                decode = lambda ids, model=sequence.model: self.engine.decode_text(ids, model)  # its tokenizer's
                sequence.text = TextStream(decode, sequence.stop)
                sequence.generator = make_generator(sequence.sampling)
            tokens = self._sample(sequences, self.engine.prefill(batch))
            self.stats.record_forward(batch.models, prefill=True)
            keep = self._deliver(sequences, tokens)
        except Exception:  # nothing of these rows is in the running batch yet: fail them alone
            logger.exception("finetune serve: a prefill failed")
            for sequence in sequences:
                self._fail(sequence, internal_error())
            return
        if not keep:
            return
        batch.select(keep)
        kept = [sequences[i] for i in keep]
        with self._cond:
            if self._batch is None:
                self._batch, self._running = batch, kept
            else:
                self._batch.join(batch)
                self._running = self._running + kept
                self.stats.record_join()

    def _step(self) -> None:
        assert self._batch is not None and len(self._batch) == len(self._running)
        try:
            last = [sequence.generated[-1] for sequence in self._running]
            tokens = self._sample(self._running, self.engine.step(self._batch, last))
        except Exception:
            logger.exception("finetune serve: a decode step failed")
            self._fail_running()
            return
        self.stats.record_forward(self._batch.models, prefill=False)
        keep = self._deliver(self._running, tokens)
        if len(keep) == len(self._running):
            return
        with self._cond:
            if keep:
                self._batch.select(keep)
                self._running = [self._running[i] for i in keep]
            else:
                self._batch, self._running = None, []

    @property
    def _pad_id(self) -> int:
        return self.engine.pad_token_id

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> list[int]:
        """The next token of each row. A row whose scores hold NaN or +inf (an adapter whose update overflows in
        the model's dtype) fails alone, with a 500 naming its model: sampled, it raised in `torch.multinomial`
        and failed every row of its forward (a 500 for other clients' requests too); greedy, it emitted token 0
        after token 0 as a reply. Its scores are zeroed so the other rows still sample; `_deliver` drops it."""
        broken = (logits.isnan() | logits.isposinf()).any(dim=-1).nonzero().flatten().tolist()
        if broken:
            logits = logits.clone()
            for row in broken:
                self._fail(sequences[row], _non_finite_error(sequences[row].model))
                sequences[row].cancelled = True  # nobody waits for it any more: it leaves the batch
                logits[row] = 0
        return next_tokens(logits, [s.sampling for s in sequences], [s.generator for s in sequences])

    def _deliver(self, sequences: list[Sequence], tokens: list[int]) -> list[int]:
        """Give each sequence its new token; return the indices of those that go on."""
        keep = []
        for i, (sequence, token) in enumerate(zip(sequences, tokens)):
            if sequence.cancelled:
                continue
            sequence.generated.append(token)
            if token in self.engine.stop_token_ids or token in sequence.stop_ids:
                self._finish(sequence, "stop")
                continue
            piece = sequence.decoded.push(token)
            if piece and sequence.stream:
                self._emit(sequence, Piece(sequence.index, piece))
            if sequence.decoded.stopped:
                self._finish(sequence, "stop")
            elif len(sequence.generated) >= sequence.max_new_tokens:
                self._finish(sequence, "length")
            else:
                keep.append(i)
        return keep

    def _finish(self, sequence: Sequence, reason: str) -> None:
        rest = sequence.decoded.finish()
        if rest and sequence.stream:
            self._emit(sequence, Piece(sequence.index, rest))
        self.stats.count(failed=False)
        finished = Finished(
            sequence.index, sequence.decoded.text, reason, sequence.prompt_ids, list(sequence.generated)
        )
        self._emit(sequence, finished)

    def _fail(self, sequence: Sequence, error: ServeError) -> None:
        self.stats.count(failed=True)
        self._emit(sequence, Failed(sequence.index, error))

    def _fail_running(self) -> None:
        with self._cond:
            running, self._running, self._batch = self._running, [], None
        for sequence in running:
            self._fail(sequence, internal_error())

    @staticmethod
    def _emit(sequence: Sequence, event: Event) -> None:
        try:
            sequence.emit(event)
        except Exception:  # the client's event loop is gone: nobody is listening
            logger.debug("finetune serve: dropped an event for a closed request", exc_info=True)


def _non_finite_error(model: str) -> ServeError:
    return ServeError(
        f"the model {model!r} gave NaN or infinite scores for this request (its weights or activations overflow in "
        "the served dtype); serve it in float32 (--dtype float32), or retrain or rescale the adapter",
        status=500,
        error_type="server_error",
        code="non_finite_logits",
    )


def internal_error() -> ServeError:
    """A 500 in OpenAI's shape: what a client gets when the server, not its request, failed."""
    return ServeError(
        "internal error; see the server log", status=500, error_type="server_error", code="internal_error"
    )
