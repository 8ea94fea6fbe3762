"""Experiment trackers (`train.report_to`): TensorBoard, MLflow, Weights & Biases, trackio, through accelerate.

accelerate owns the integrations: `Accelerator(log_with=...)` names the trackers, `init_trackers` starts
a run in each with the resolved recipe as its configuration, and `accelerator.log` sends metrics to all
of them from the main process. This module chooses and checks them, and feeds them the records the run's
`TrainingLog` writes to metrics.jsonl (same steps, same values), plus the base model's held-out metrics.

- TensorBoard (the default) writes into `<run_dir>/tensorboard/`.
- MLflow logs to `MLFLOW_TRACKING_URI` (default: mlflow's own, `sqlite:///mlflow.db` in the working
  directory; `file:` stores need `MLFLOW_ALLOW_FILE_STORE=true` since mlflow 3.7), experiment
  `train.tracker_project` unless `MLFLOW_EXPERIMENT_NAME` says otherwise.
- wandb logs to project `train.tracker_project`, files under `<run_dir>/wandb/`; `WANDB_MODE=offline`
  keeps everything local (`wandb sync` uploads later).
- trackio logs to its local database (`TRACKIO_DIR`, default under ~/.cache/huggingface/trackio).

A tracker whose package is missing is a recipe error naming the package, before anything is loaded
(`finetune.recipe.TRACKER_PACKAGES`).

A resumed run (`--resume`) starts a new run in wandb, MLflow and trackio, and first sends it the history that
metrics.jsonl keeps (up to the checkpoint, with the base model's figures at step 0): none of them can drop points
from a run it holds (wandb's rewind is a server feature, offline runs have none), so reopening the interrupted
run would show the steps trained again twice, the killed process's values beside the resumed ones. The new run
holds each step once, with the values of the run that wrote the adapter; the interrupted run stays, as it was
left. TensorBoard keeps one run directory and purges the steps trained again (`log_with`).

Example:
    accelerator = Accelerator(log_with=log_with(recipe))
    trackers = Trackers.start(accelerator, recipe, base_eval={"eval_loss": 5.8, "eval_ppl": 345.5}, step=0)
    trackers.resend_history(run_dir / "metrics.jsonl")   # a resumed run (step > 0), once its log has truncated it
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune.errors import TrainingError, first_line
from finetune.recipe import Recipe, recipe_to_dict


def log_with(recipe: Recipe, resumed_at: int = 0) -> list[Any] | None:
    """`Accelerator(log_with=...)` for the recipe's trackers (None for none: accelerate warns about []).

    TensorBoard is given as a tracker object so that its files land in `<run_dir>/tensorboard/`, where
    they have always been; the others are named and built by `init_trackers`. A run resumed from the checkpoint
    of step `resumed_at` purges what the earlier event files hold after that step (`purge_step`), as
    metrics.jsonl drops those records: the steps trained again were shown twice, with stale throughput.
    """
    from accelerate.tracking import TensorBoardTracker

    if not recipe.train.report_to:
        return None
    purge = {"purge_step": resumed_at + 1} if resumed_at else {}
    if resumed_at and "tensorboard" in recipe.train.report_to:
        after_earlier_event_files(recipe.output.run_path / "tensorboard")
    return [
        TensorBoardTracker("tensorboard", str(recipe.output.run_path), **purge) if name == "tensorboard" else name
        for name in recipe.train.report_to
    ]


def after_earlier_event_files(log_dir: Path) -> None:
    """Wait, where needed, until the next writer's event file sorts after those in `log_dir`.

    TensorBoard reads a run's event files in name order, `events.out.tfevents.<second>.<host>.<pid>.<n>`, n counting
    the writers this process has made: a run resumed in the same second and process as the one it resumes (the
    Python API, a short run) sorted first once n gained a digit (`.10` before `.9`), so the purge of the steps trained
    again was read before those steps, which then showed twice. At most a second's wait, and only then.
    """
    seconds = [
        int(part) for part in (p.name.split(".")[3] for p in log_dir.glob("events.out.tfevents.*")) if part.isdigit()
    ]
    if seconds and max(seconds) >= int(time.time()):
        time.sleep(max(seconds) + 1 - time.time())


def flat_config(values: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """The resolved recipe as dotted keys with scalar values (`lora.r: 8`): what every tracker accepts.

    Lists become JSON text and None becomes "null" (TensorBoard's hparams refuse both).
    """
    flat: dict[str, str | int | float | bool] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_config(value, prefix=f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


class Trackers:
    """The accelerator's trackers for one run: started with the recipe, fed records, finished once."""

    def __init__(self, accelerator: Any, base_metrics: Mapping[str, float] | None = None) -> None:
        self.accelerator = accelerator
        self.base_metrics = dict(base_metrics or {})  # the held-out figures before training, as logged at step 0

    @classmethod
    def start(cls, accelerator: Any, recipe: Recipe, base_eval: Mapping[str, float], step: int) -> Trackers:
        """Start a run in each tracker (main process), with the recipe as its configuration and the base
        model's held-out metrics (`base_eval_loss`, `base_eval_ppl`; `start_...` where the run starts from another
        adapter: `Recipe.start_metrics_prefix`) logged at `step` 0 (a resumed run, at a later `step`, logged them
        when it started).

        wandb's directory is given absolute: its service process, started by the first run in a process, resolves a
        relative one against its own working directory, so a later run after a `chdir` (a notebook, a script of
        several runs) wrote its run file nowhere and lost its whole history without a word."""
        run_name = recipe.output.name
        try:
            accelerator.init_trackers(
                recipe.train.tracker_project,
                config=flat_config(recipe_to_dict(recipe)),
                init_kwargs={
                    "wandb": {"name": run_name, "dir": str(recipe.output.run_path.absolute())},
                    "mlflow": {"run_name": run_name},
                    "trackio": {"name": run_name},
                },
            )
        except Exception as exc:  # the tracker's own settings (a URI, a login, a store): the user's to fix
            raise TrainingError(
                f"train.report_to {recipe.train.report_to}: a tracker failed to start ({type(exc).__name__}: "
                f"{first_line(exc)}); fix its settings (environment variables, login) or leave it out of train.report_to"
            ) from None
        trackers = cls(accelerator, {f"{recipe.start_metrics_prefix}{key}": value for key, value in base_eval.items()})
        if trackers.base_metrics and step == 0:  # a resumed run sends them with its history (`resend_history`)
            trackers.log(step, trackers.base_metrics)
        return trackers

    def resend_history(self, metrics_path: Path) -> None:
        """Send a resumed run's new tracker runs what the run logged before its checkpoint: the base model's figures
        at step 0, then each record metrics.jsonl keeps (call it once the log has dropped those past the checkpoint).
        Not to TensorBoard, whose run directory still holds them. A null (a non-finite value) is sent as NaN."""
        targets = [tracker for tracker in self.accelerator.trackers if tracker.name != "tensorboard"]
        if not targets or not self.accelerator.is_main_process:
            return
        history = [(0, self.base_metrics)] if self.base_metrics else []
        if metrics_path.exists():
            for line in metrics_path.read_bytes().decode("utf-8", errors="replace").splitlines():
                record = json.loads(line)
                step = record.pop("step")
                history.append((step, {key: math.nan if value is None else value for key, value in record.items()}))
        for step, values in history:
            for tracker in targets:
                tracker.log(values, step=step)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Send one record (as written to metrics.jsonl) to every tracker."""
        if self.accelerator.trackers:
            self.accelerator.log(dict(values), step=step)

    def close(self) -> None:
        """Finish every tracker's run (flush, close files). Not `accelerator.end_training()`: that also
        destroys the process group, which later runs in the same process still need."""
        if self.accelerator.is_main_process:
            for tracker in self.accelerator.trackers:
                tracker.finish()
        self.accelerator.trackers = []
