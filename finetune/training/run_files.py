"""What a run directory holds, and what refuses a run before it starts, read without torch.

`finetune train --nproc N` hands the run to N ranks, and each one that finds the same fault (a --resume with
no checkpoint, or one written by another number of processes; an adapter or an earlier run in the way of a
fresh run) printed the same error: N lines, or one and a "rank 0 was ended by SIGTERM" from the launcher, as
the ranks raced. `check_before_launch` refuses these once, in the launching process, which must stay free of
torch (1.3 s of every CPU launch); the ranks check again with the same messages (the Python API, a run
launched by `accelerate launch` directly).

Example:
    check_before_launch(recipe, resume=True, processes=2)   # CheckpointError: ... resume with --nproc 1
    latest_checkpoint(Path("runs/legal"))                    # runs/legal/checkpoint-000120
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.atomic import check_writable
from finetune.errors import CheckpointError, OutputError, RecipeError
from finetune.recipe import Recipe

PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
START_FILE = "initial-adapter.safetensors"
"""The trainable weights as a run started, where its LoRA initialisation changed the base (PiSSA, OLoRA)."""
RUN_RECORD_FILE = "run.json"
"""What a finished run produced (`finetune.report.runs.RUN_RECORD_NAME`), written when it ends: left from an earlier run,
`finetune report` of a new one that was killed read it as the new run's and tabled the old run's adapter, recipe and
held-out figures beside the new run's curves."""
METRICS_FILE = "metrics.jsonl"
RUN_FILES = (METRICS_FILE, "report.html", "plots", "tensorboard", START_FILE, RUN_RECORD_FILE)
"""What a run writes into its run directory besides its checkpoints."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"{PREFIX}{step:06d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory (`checkpoint-000120`) was written at."""
    return int(path.name[len(PREFIX) :])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (hidden staging leftovers of a crash are ignored)."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def resume_checkpoint(run_dir: Path) -> Path:
    """The checkpoint --resume continues from: the newest in `run_dir`."""
    path = latest_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"--resume: no checkpoint in {run_dir}; run without --resume to start fresh")
    return path


def check_process_count(path: Path, written_by: int, processes: int) -> None:
    """A checkpoint resumes with the number of processes that wrote it (its data position and RNG are per rank)."""
    if written_by != processes:
        raise CheckpointError(
            f"{path} was written by {written_by} process(es) but this run has {processes}; resume with "
            f"--nproc {written_by}"
        )


def earlier_run_files(run_dir: Path) -> list[Path]:
    """An earlier run's checkpoints and files in `run_dir`: what a fresh run must not mix with."""
    return list_checkpoints(run_dir) + [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]


def adapter_taken(recipe: Recipe) -> bool:
    adapter_dir = recipe.output.adapter_dir
    return adapter_dir.exists() or adapter_dir.is_symlink()


def taken_adapter_error(recipe: Recipe) -> RecipeError:
    return RecipeError(
        f"output: {recipe.output.adapter_dir} already exists; choose another output.name, or set output.overwrite=true"
    )


def earlier_run_error(run_dir: Path) -> RecipeError:
    return RecipeError(
        f"output: {run_dir} holds an earlier run's checkpoints or metrics; continue it with --resume, or set "
        "output.overwrite=true to start over (they are deleted)"
    )


def check_places_writable(recipe: Recipe) -> None:
    """The adapter's directory and the run directory (checkpoints, metrics) take new files: found at the end, a
    read-only or misspelled place (a file on the way) cost the whole run."""
    check_writable(recipe.output.adapter_dir, OutputError)
    check_writable(recipe.output.run_path / METRICS_FILE, OutputError)


def check_before_launch(recipe: Recipe, *, resume: bool, processes: int) -> None:
    """Refuse, once, what every one of `processes` ranks would refuse alike at its start."""
    check_places_writable(recipe)
    run_dir = recipe.output.run_path
    if resume:
        path = resume_checkpoint(run_dir)
        try:
            written_by = len(json.loads((path / STATE_FILE).read_text())["rng"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # unreadable: the ranks' own loading says so, naming what is wrong
        check_process_count(path, written_by, processes)
        return
    if recipe.output.overwrite:
        return  # the ranks replace what may be replaced, and refuse the rest
    if adapter_taken(recipe):
        raise taken_adapter_error(recipe)
    if earlier_run_files(run_dir):
        raise earlier_run_error(run_dir)
