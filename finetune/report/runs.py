"""Reading a training run back: its metrics.jsonl history and the record of what it produced (run.json).

A run directory holds `metrics.jsonl` (one JSON object per reported step: training metrics on log steps,
held-out metrics after each evaluation) and, once training has finished, `run.json`: where the adapter
went and a copy of its manifest (base, fingerprint, recipe, data, final metrics, wall time). A run that
was resumed wrote some steps twice; the later record of a step wins, as it is the one the adapter
continued from. A run without run.json (still going, or killed) is reported from its metrics alone.

Example:
    run = read_run(Path("runs/quickstart"))
    steps, losses = run.series("loss")
    run.manifest.metrics["eval_ppl"], run.base_metric("eval_ppl")
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune import strict_json
from finetune.atomic import atomic_file
from finetune.errors import ReportError
from finetune.manifest import Manifest

METRICS_NAME = "metrics.jsonl"
RUN_RECORD_NAME = "run.json"


@dataclass(frozen=True)
class RunHistory:
    """One run as a report sees it: training and evaluation records by step, and its manifest if finished."""

    name: str
    run_dir: Path
    train: list[dict[str, float]]
    """Training records (`loss`, `lr`, `tokens_per_s`, `tokens_seen`, ...), one per logged step, by step."""
    evals: list[dict[str, float]]
    """Held-out records (`eval_loss`, `eval_ppl`, ...), one per evaluation, by step."""
    manifest: Manifest | None
    adapter_dir: str | None

    def series(self, key: str, x: str = "step", evaluation: bool = False) -> tuple[list[float], list[float]]:
        """(x values, y values) of `key` over the records that have both."""
        rows = self.evals if evaluation else self.train
        pairs = [(row[x], row[key]) for row in rows if row.get(x) is not None and row.get(key) is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def base_metric(self, key: str) -> float | None:
        """The held-out `eval_loss`/`eval_ppl`/... before training, when the run recorded it: the base model's, or
        the starting adapter's of a preference or GRPO run that started from one (`starts_from_adapter`)."""
        value = self.metrics.get(f"base_{key}")
        return self.metrics.get(f"start_{key}") if value is None else value

    @property
    def starts_from_adapter(self) -> bool:
        """Whether the figures before training are a starting adapter's (`lora.init_from`, PiSSA/OLoRA), not the
        base's (`Recipe.start_metrics_prefix`)."""
        return any(key.startswith("start_eval_") for key in self.metrics)

    @property
    def scores_own_samples(self) -> bool:
        """An online objective's run (GRPO): its evaluations sample their own completions, so their loss and
        perplexity are not held-out figures (perplexity of what the model itself wrote); the reward is."""
        return "eval_reward" in self.metrics or any("eval_reward" in row for row in self.evals)

    @property
    def metrics(self) -> dict[str, Any]:
        """The final metrics of a finished run ({} if it has not finished)."""
        return self.manifest.metrics if self.manifest is not None else {}


def _read_records(path: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """Training and evaluation records by step; a torn last line (a killed run) is skipped.

    Lines are decoded one by one, so bytes that are not UTF-8 (a damaged file) make that line a bad record, named
    by its number, like a step of Infinity (OverflowError in `int`), not a traceback.
    """
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    lines = path.read_bytes().splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            step = _whole_step(record["step"])
        except (ValueError, KeyError, TypeError, OverflowError):  # UnicodeDecodeError is a ValueError
            if number == len(lines):
                break
            raise ReportError(f"{path}:{number} is not a metrics record; fix or delete that line") from None
        target = evals if "eval_loss" in record else train
        target[step] = {**record, "step": step}
    return train, evals


def _whole_step(value: object) -> int:
    """A record's step as an int: `2.0` is step 2, but `2.5` (or `true`) is no step. `int()` alone took 2.5 for 2 and
    kept the float in the record, and the run table's `{step:d}` then failed with a ValueError traceback."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"step {value!r} is not a number")
    step = int(value)  # OverflowError for Infinity, ValueError for NaN
    if step != value:
        raise ValueError(f"step {value!r} is not a whole number")
    return step


def read_run(run_dir: str | Path) -> RunHistory:
    """Read a run directory written by `finetune train`.

    Raises:
        ReportError: no metrics.jsonl, or a malformed record in it.
    """
    run_dir = Path(run_dir)
    metrics_file = run_dir / METRICS_NAME
    if not metrics_file.is_file():
        raise ReportError(
            f"{run_dir} has no {METRICS_NAME}; give a run directory written by finetune train (runs/NAME)"
        )
    train, evals = _read_records(metrics_file)
    manifest, adapter_dir = None, None
    record_file = run_dir / RUN_RECORD_NAME
    if record_file.is_file():
        try:
            record = json.loads(record_file.read_text(encoding="utf-8"))
            manifest = Manifest.model_validate(record["manifest"]) if record.get("manifest") else None
            adapter_dir = record.get("adapter_dir")
        except (ValueError, AttributeError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ReportError(
                f"{record_file} is not a run record ({type(exc).__name__}); delete it to report the run from its "
                f"{METRICS_NAME} alone"
            ) from None
    name = manifest.name if manifest is not None else run_dir.resolve().name
    return RunHistory(
        name=name,
        run_dir=run_dir,
        train=[train[step] for step in sorted(train)],
        evals=[evals[step] for step in sorted(evals)],
        manifest=manifest,
        adapter_dir=adapter_dir,
    )


def write_run_record(run_dir: Path, adapter_dir: Path, manifest: Manifest | None) -> Path:
    """Write run.json (where the adapter went and its manifest) into the run directory, atomically."""
    path = Path(run_dir) / RUN_RECORD_NAME
    record = {"adapter_dir": str(adapter_dir), "manifest": manifest.model_dump(mode="json") if manifest else None}
    with atomic_file(path) as staging:
        staging.write_text(strict_json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def perplexity_change(base_ppl: float, ppl: float) -> str:
    """'97.3% lower' or '12.0% higher': how `ppl` compares with the base's, in words a log line can hold. A
    perplexity past float range (inf: `finetune.scoring.perplexity_of`) or NaN has no percentage."""
    if not (math.isfinite(base_ppl) and math.isfinite(ppl)):
        return "no percentage: a perplexity is not a finite number"
    change = 100 * (1 - ppl / base_ppl)
    return f"{change:.1f}% lower" if change >= 0 else f"{-change:.1f}% higher"
