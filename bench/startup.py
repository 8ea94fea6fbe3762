"""Start-up of the CLI, in fresh processes: what a user waits for before anything useful happens.

Three figures, each the median of `--repeats` fresh processes after one warm-up run (so the OS file cache
holds the libraries, as it does on a machine in use):
- `finetune --help`: the CLI's own start (argument parsing, no torch);
- `finetune generate` of 40 new tokens on the embedded base with an adapter in use, wall seconds from
  process start to exit (the inference half: no training stack is imported);
- the import seconds of a one-step `finetune train` on the quickstart recipe: the sum of the top-level
  cumulative times `python -X importtime` reports over the whole run, i.e. everything imported before
  (and during) its first step.

The adapter is trained once in the scratch directory (2 steps of the quickstart recipe). Nothing is
downloaded. Figures depend on the CPU (named in the output) and on what else runs.

Example:
    python bench/startup.py --repeats 5
    python bench/startup.py --repeats 3 --json /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "### Instruction:\nWrite the weather bulletin for Kesgate.\n\n### Input:\nDay: 3 Hightide\n\n### Response:\n"
NEW_TOKENS = 40


def cpu_model() -> str:
    """The processor's name as /proc/cpuinfo gives it (`python -m bench` records it too)."""
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _environment(scratch: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("FINETUNE_HOME", str(scratch / "home"))
    env.setdefault("HF_DATASETS_CACHE", str(scratch / "datasets"))
    return env


def _cli() -> list[str]:
    """The `finetune` console script where installed (what users run), else `python -m finetune`."""
    script = shutil.which("finetune")
    return [script] if script else [sys.executable, "-m", "finetune"]


def _wall_seconds(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def median_wall_seconds(command: list[str], env: dict[str, str], repeats: int) -> float:
    _wall_seconds(command, env)  # warm-up: the file cache, compiled bytecode
    return statistics.median(_wall_seconds(command, env) for _ in range(repeats))


def import_seconds(importtime_log: str) -> float:
    """Total import time from `python -X importtime` output: the sum of the top-level modules' cumulative
    microseconds (a nested import is counted inside its parent's cumulative time)."""
    total_us = 0
    for line in importtime_log.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part for part in line[len("import time:") :].split("|"))
        if not name.startswith("  "):  # one space after the bar: a top-level import
            total_us += int(cumulative)
    return total_us / 1e6


def _train_arguments(scratch: Path, name: str, steps: int) -> list[str]:
    return [
        "train",
        "recipes/quickstart.yaml",
        f"train.max_steps={steps}",
        f"output.dir={scratch / name}",
        f"output.run_dir={scratch / 'runs' / name}",
        "output.report=false",
    ]


def train_import_seconds(scratch: Path, env: dict[str, str], repeats: int) -> float:
    command = [sys.executable, "-X", "importtime", "-m", "finetune", *_train_arguments(scratch, "one-step", 1)]
    figures = []
    for _ in range(repeats + 1):  # the first run warms the caches (tokenized data, the base)
        completed = subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True, text=True)
        figures.append(import_seconds(completed.stderr))
    return statistics.median(figures[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scratch", type=Path, help="where the adapter and caches go (default: a temporary dir)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="finetune-startup-"))
    env = _environment(scratch)
    adapter = scratch / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        subprocess.run([*_cli(), *_train_arguments(scratch, "adapter", 2)], env=env, cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    generate = [*_cli(), "generate", "--adapter", str(adapter), "--max-new-tokens", str(NEW_TOKENS), PROMPT]
    figures = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "repeats": args.repeats,
        "help_seconds": median_wall_seconds([*_cli(), "--help"], env, args.repeats),
        "generate_seconds": median_wall_seconds(generate, env, args.repeats),
        "train_import_seconds": train_import_seconds(scratch, env, args.repeats),
    }
    print(f"start-up on {figures['cpu']}, {figures['cores']} cores (median of {args.repeats} fresh processes)")
    print(f"  finetune --help                                  {figures['help_seconds']:.2f} s wall")
    print(f"  finetune generate, {NEW_TOKENS} tokens, embedded base + adapter {figures['generate_seconds']:.2f} s wall")
    print(f"  imports of a one-step finetune train             {figures['train_import_seconds']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
