"""Progress of a training run, reported through one callback: `on_step(step, metrics)`.

The loop calls it once after every optimizer step with that step's training metrics (`loss`, `lr`,
`tokens_per_s`, `epoch`, `tokens_seen`, and `grad_norm` when gradients are clipped), and once after each
evaluation with `eval_loss`, `eval_ppl` and `eval_tokens` for the same step. Everything that shows or
records progress consumes that stream: the progress bar, the log lines, the metrics file (metrics.jsonl +
TensorBoard), and any callback a caller of `finetune.train.train` passes.

Example:
    report = fan_out([ProgressBar(total_steps=150), LogInterval(MetricsFile(run_dir), every_steps=10, total_steps=150)])
    report(1, {"loss": 2.31, "lr": 1e-3, "tokens_per_s": 5200.0, "epoch": 0.01, "tokens_seen": 2048})
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

StepCallback = Callable[[int, dict[str, float]], None]


def is_evaluation(metrics: dict[str, float]) -> bool:
    """Whether `metrics` are an evaluation's (else one optimizer step's training metrics)."""
    return "eval_loss" in metrics


def fan_out(callbacks: Sequence[StepCallback]) -> StepCallback:
    """One callback that calls each of `callbacks` in order."""

    def report(step: int, metrics: dict[str, float]) -> None:
        for callback in callbacks:
            callback(step, metrics)

    return report


@dataclass(frozen=True)
class LogInterval:
    """`callback` for every evaluation and for training metrics every `every_steps`-th step and the last."""

    callback: StepCallback
    every_steps: int
    total_steps: int

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if is_evaluation(metrics) or step % self.every_steps == 0 or step == self.total_steps:
            self.callback(step, metrics)


class MetricsFile:
    """Appends every reported step to `metrics.jsonl` and TensorBoard in the run directory."""

    def __init__(self, run_dir: Path) -> None:
        # TensorBoard's writer takes about a second to import; only a training main process needs it.
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        self._tensorboard.close()


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class LogLines:
    """A log line per evaluation and, when `with_steps`, per reported training step with its ETA."""

    def __init__(self, say: Callable[[str], None], *, total_steps: int, start_step: int, with_steps: bool) -> None:
        self.say = say
        self.total_steps = total_steps
        self.with_steps = with_steps
        self._start_step, self._start_seconds = start_step, time.perf_counter()

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if is_evaluation(metrics):
            self.say(f"step {step}: eval loss {metrics['eval_loss']:.4f}, perplexity {metrics['eval_ppl']:.3f}")
        elif self.with_steps:
            seconds_per_step = (time.perf_counter() - self._start_seconds) / max(step - self._start_step, 1)
            eta = format_seconds(seconds_per_step * (self.total_steps - step))
            self.say(
                f"step {step}/{self.total_steps}: loss {metrics['loss']:.4f}, lr {metrics['lr']:.3g}, "
                f"{metrics['tokens_per_s']:,.0f} tokens/s, ETA {eta}"
            )


class ProgressBar:
    """A tqdm bar over optimizer steps, showing the last step's loss and throughput."""

    def __init__(self, *, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self._bar = tqdm(total=total_steps, initial=start_step, disable=not enabled, unit="step", dynamic_ncols=True)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if is_evaluation(metrics):
            return
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_s']:,.0f}")

    def close(self) -> None:
        self._bar.close()
