"""The inference half starts without the training stack: what each command really imports.

Each command runs for real in a fresh interpreter (as the `finetune` script would run it), and the
modules loaded by the time it exits are read from `sys.modules`. Training (`finetune.training`, its
trackers, deepspeed, trl) and bitsandbytes (which pulls in torch's inductor) cost seconds of start-up
that `generate`, `eval`, `adapters merge`, `plan` and `export` never need.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from adapter_fixtures import adapter_dirs  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[1]
# Module name prefixes no inference command may load (bitsandbytes only with a quantized base).
TRAINING_ONLY = ("finetune.training", "bitsandbytes", "deepspeed", "trl", "wandb", "mlflow", "trackio")

_RECORD_MODULES = """
import atexit, json, runpy, sys
record = sys.argv.pop(1)
atexit.register(lambda: open(record, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["finetune", *sys.argv[1:]]
runpy.run_module("finetune", run_name="__main__")
"""


def loaded_modules(tmp_path: Path, *arguments: str) -> set[str]:
    """The modules loaded by `finetune ARGUMENTS...` in a fresh interpreter, read when it exits."""
    record = tmp_path / f"modules-{len(list(tmp_path.glob('modules-*')))}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    completed = subprocess.run(
        [sys.executable, "-c", _RECORD_MODULES, str(record), *arguments],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    return set(json.loads(record.read_text()))


def training_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in TRAINING_ONLY))


def test_importing_the_api_loads_no_training(tmp_path):
    code = "import json, sys, finetune.api; print(json.dumps(sorted(sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                               capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    modules = set(json.loads(completed.stdout))
    assert "finetune.adapters.inmemory" in modules and "transformers" in modules  # it imported what inference needs
    assert training_modules(modules) == []


@pytest.mark.slow
def test_inference_commands_load_no_training(tmp_path, tiny_base_dir, adapter_dirs):  # noqa: F811
    records = [{"text": "the cat sat on the mat and the dog sat on the log"} for _ in range(4)]
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    base, adapter = str(tiny_base_dir), str(adapter_dirs["legal"])
    merged = str(tmp_path / "merged")
    commands = {
        "generate": ["generate", "--base", base, "--adapter", adapter, "--max-new-tokens", "4", "the cat"],
        "eval": ["eval", "--base", base, "--adapter", adapter, "--data", "valid.jsonl", "--max-seq-len", "64"],
        "adapters merge": ["adapters", "merge", "--base", base, "--adapter", adapter, "--out", merged],
        "plan": ["plan", "quickstart"],
    }
    loaded = {name: loaded_modules(tmp_path, *arguments) for name, arguments in commands.items()}
    assert "finetune.scoring" in loaded["eval"] and "peft" in loaded["generate"]  # they ran what they say
    assert (tmp_path / "merged").is_dir()
    assert {name: training_modules(modules) for name, modules in loaded.items()} == {name: [] for name in commands}


def test_training_an_unquantized_base_loads_no_bitsandbytes_or_deepspeed(workdir):
    """bitsandbytes (which imports torch's inductor) only for a 4-/8-bit base or an 8-bit optimizer, deepspeed only
    for its strategy: seconds of every training process's start (transformers' scheduler module imported peft,
    and with it bitsandbytes, before finetune could hide it)."""
    modules = loaded_modules(workdir, "train", "recipe.yaml", "train.max_steps=1", "output.name=one")
    assert "finetune.training.loop" in modules and (workdir / "adapters" / "one").is_dir()  # it trained
    assert sorted(m for m in modules if m.split(".")[0] in ("bitsandbytes", "deepspeed")) == []
