"""What a training run reports as it goes: one `on_step(step, metrics)` callback, and its standard consumer.

The loop in `finetune.training.loop` calls `on_step` once per optimizer step, in order, when it reads the steps'
metrics (at the logging interval, before an evaluation or checkpoint, and at the end), with that step's metrics (`loss`,
`lr`, `grad_norm`, `tokens_seen`, `epoch`, `elapsed_s`, the objective's own (a preference objective's
`rewards_chosen`, `reward_accuracy`, ...), and `eval_loss`/`eval_ppl` (and `eval_reward_accuracy`, ...)
after an evaluation during the run). The final evaluation, after the last step, is not a step's: it is in the
`TrainResult.metrics` that `train` returns and in metrics.jsonl. Everything that reports progress consumes that one stream: `TrainingLog` (metrics.jsonl,
the console line or progress bar, and the experiment trackers of `finetune.training.tracking`, TensorBoard among
them, which receive exactly the records metrics.jsonl gets), a benchmark timing the run, a user's own callback.

Example:
    log = TrainingLog(run_dir, total_steps=150, log_every_steps=10, say=print, show_bar=False)
    train("recipes/quickstart.yaml", on_step=lambda step, metrics: print(step, metrics["loss"]))
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from finetune import strict_json
from finetune.atomic import atomic_file, unwritable_as
from finetune.errors import OutputError
from finetune.training.objectives.base import describe_rewards

StepCallback = Callable[[int, dict[str, float]], None]
Say = Callable[[str], None]
_NOT_RECORDED = ("elapsed_s", "skipped_steps")
"""Step metrics the log keeps out of metrics.jsonl (the run's clock, and a count its manifest records)."""


def fan_out(*callbacks: StepCallback | None) -> StepCallback:
    """One `on_step` that calls each given callback in turn (None entries are skipped), each with its own copy
    of the metrics: the loop keeps the dict it reports as the run's last metrics (the manifest's, the checkpoint's,
    `TrainResult.metrics`), so a user's callback that pops, clears or adds keys had changed those silently."""
    chosen = [c for c in callbacks if c is not None]

    def on_step(step: int, metrics: dict[str, float]) -> None:
        for callback in chosen:
            callback(step, dict(metrics))

    return on_step


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _drop_records_after(path: Path, step: int, *, last_step: bool) -> None:
    """Keep the records of `path` up to `step`: a run resumed from a checkpoint at `step` writes the later steps
    again, and a run killed after its last checkpoint had written some of them already. At the run's `last_step`
    the evaluation at `step` goes too: it is the final one, which comes after the last checkpoint and runs again."""
    if not path.exists():
        return
    # bytes that are not UTF-8 (a damaged file) make their line unreadable, dropped like a torn one
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
    kept = [line for line in lines if (logged := _step_of(line)) is not None and logged <= step]
    if last_step:
        kept = [
            line for line in kept if _step_of(line) != step or not any(k.startswith("eval_") for k in json.loads(line))
        ]
    if len(kept) != len(lines):
        with atomic_file(path) as staging:  # a kill while rewriting leaves the whole old history, not half of it
            staging.write_text("".join(kept))


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line a killed process left half-written (or damaged:
    a step of Infinity is an OverflowError in `int`)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError, OverflowError):
        return None


class TrainingLog:
    """metrics.jsonl in the run directory (each record also to `record`: the trackers), and a console line
    or bar, every N steps.

    Train metrics are written every `log_every_steps` steps and at the last step, with `tokens_per_s`
    measured over the steps since the previous write; evaluations are written whenever they happen.
    """

    def __init__(
        self,
        run_dir: Path | None,
        *,
        total_steps: int,
        first_step: int,
        log_every_steps: int,
        first_tokens_seen: int = 0,
        say: Say,
        show_bar: bool,
        record: StepCallback | None = None,
    ) -> None:
        self.run_dir, self.total_steps, self.log_every_steps, self.say = run_dir, total_steps, log_every_steps, say
        self.show_bar = show_bar
        self._bar = tqdm(total=total_steps, initial=first_step, disable=not show_bar, unit="step", dynamic_ncols=True)
        self._record = record
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            _drop_records_after(run_dir / "metrics.jsonl", first_step, last_step=first_step == total_steps)
        self._start = (time.perf_counter(), first_step)
        self._last = (0.0, first_tokens_seen)  # (elapsed_s, tokens_seen) at the previous write: a resumed run's
        # first rate counts only the tokens it trained itself, not those of the steps before its checkpoint

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        self.log_eval(step, {k: v for k, v in metrics.items() if k.startswith("eval_")})
        if step % self.log_every_steps == 0 or step == self.total_steps:
            self._log_train(step, metrics)

    def log_eval(self, step: int, eval_metrics: dict[str, float]) -> None:
        """Write and print an evaluation's results (nothing when `eval_metrics` is empty)."""
        if not eval_metrics:
            return
        self._write(step, eval_metrics)
        if "eval_reward" in eval_metrics:  # an online objective: its loss on its own samples says nothing
            self._say_beside_bar(f"step {step}: held-out reward {eval_metrics['eval_reward']:.3f}")
            return
        self._say_beside_bar(
            f"step {step}: eval loss {eval_metrics['eval_loss']:.4f}, perplexity {eval_metrics['eval_ppl']:.3f}"
            + describe_rewards(eval_metrics, prefix="eval_")
        )

    def _say_beside_bar(self, line: str) -> None:
        """`say` a line with the bar cleared first and drawn again after it: printed over a drawn bar, the line
        began where the bar ended (`| 1/6 [00:07<00:37, 7.46s/step]step 2: eval loss ...`) on a terminal."""
        if not self.show_bar:
            self.say(line)
            return
        self._bar.clear()
        self.say(line)
        self._bar.refresh()

    def _log_train(self, step: int, metrics: dict[str, float]) -> None:
        elapsed_s, tokens_seen = metrics["elapsed_s"], metrics["tokens_seen"]
        tokens_per_s = (tokens_seen - self._last[1]) / max(elapsed_s - self._last[0], 1e-9)
        self._last = (elapsed_s, int(tokens_seen))
        keys = ("loss", "lr", "epoch", "tokens_seen", "grad_norm")
        objective = {k: v for k, v in metrics.items() if k not in (*keys, *_NOT_RECORDED) and not k.startswith("eval_")}
        values = {**{k: metrics[k] for k in keys if k in metrics}, "tokens_per_s": tokens_per_s, **objective}
        self._write(step, values)
        self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        if not self.show_bar:
            start_time, start_step = self._start
            seconds_per_step = (time.perf_counter() - start_time) / max(step - start_step, 1)
            eta = format_seconds(seconds_per_step * (self.total_steps - step))
            self.say(
                f"step {step}/{self.total_steps}: loss {metrics['loss']:.4f}{describe_rewards(metrics)}, "
                f"lr {metrics['lr']:.3g}, {tokens_per_s:,.0f} tokens/s, ETA {eta}"
            )

    def _write(self, step: int, values: dict[str, float]) -> None:
        if self.run_dir is None:
            return
        path = self.run_dir / "metrics.jsonl"
        with unwritable_as(OutputError, path):  # a full disk mid-run: one line, not a traceback and exit 1
            with open(path, "a") as handle:
                handle.write(strict_json.dumps({"step": step, **values}) + "\n")
        if self._record is not None:
            self._record(step, values)

    def close(self) -> None:
        self._bar.close()
