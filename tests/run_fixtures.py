"""Two finished training runs on the tiny base, shared by the report and tracker tests (one training each).

- `a`: writes its report when training ends (`output.report: true`), TensorBoard only (the default);
- `b`: `output.report: false`, and reports to TensorBoard, MLflow (a local file store) and wandb (offline).

Example:
    def test_x(trained_runs): trained_runs["a"] / "metrics.jsonl"
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import instruction_records

from finetune.training.loop import train

TRACKERS_OF_B = ["tensorboard", "mlflow", "wandb"]


def _recipe(root: Path, base_dir: Path, name: str, lr: float, report: bool, report_to: list[str]) -> str:
    return f"""
model: {{base: {base_dir}}}
lora: {{r: 4, alpha: 8}}
data: {{train: {root}/train.jsonl, validation: {root}/valid.jsonl, format: instruction, max_seq_len: 128}}
train: {{max_steps: 8, micro_batch_size: 4, lr: {lr}, warmup_steps: 2, log_every_steps: 2, eval_every_steps: 4,
         report_to: {json.dumps(report_to)}}}
output: {{name: {name}, dir: {root}/adapters/{name}, run_dir: {root}/runs/{name}, report: {str(report).lower()}}}
"""


def tracker_environment(root: Path) -> dict[str, str]:
    """Offline trackers: MLflow's file store under `root` (allowed explicitly since mlflow 3.7), wandb offline."""
    return {
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, tiny_base_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    records = instruction_records(48)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:40]))
    (root / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[40:]))
    runs = (("a", 5e-3, True, ["tensorboard"], {}), ("b", 2e-2, False, TRACKERS_OF_B, tracker_environment(root)))
    for name, lr, report, report_to, environment in runs:
        (root / f"{name}.yaml").write_text(_recipe(root, tiny_base_dir, name, lr, report, report_to))
        saved = {key: os.environ.get(key) for key in environment}
        os.environ.update(environment)
        try:
            train(root / f"{name}.yaml", log=lambda message: None, progress=False)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return {"a": root / "runs" / "a", "b": root / "runs" / "b", "root": root}
