"""The inference half starts without the training stack: what each command really imports.

Each command runs for real (as the `finetune` script would run it, forked from an interpreter that has
loaded torch and transformers only), and the modules loaded by the time it exits are read from
`sys.modules`. Training (`finetune.training`, its trackers, deepspeed, trl) and bitsandbytes (which pulls in
torch's inductor) cost seconds of start-up that `generate`, `eval`, `adapters merge`, `plan` and `export`
never need.
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

# One interpreter imports what every command shares (torch, transformers' model code: ~6 s of the ~7 s a
# command's start costs here) and forks a child per command, which runs it as the `finetune` script would and
# records `sys.modules` as it exits. The parent loads nothing a command might not (it checks that), so a
# child's modules are those a fresh interpreter running the command ends with.
_RECORD_MODULES = """
import json, os, runpy, sys
import torch, transformers, transformers.modeling_utils
commands = json.loads(sys.argv[1])
shared = [m for m in sys.modules if m.split(".")[0] in ("finetune", "peft", "datasets", *json.loads(sys.argv[2]))]
assert not shared, shared
for record, *arguments in commands:
    child = os.fork()
    if child == 0:
        status = 1
        try:
            sys.argv = ["finetune", *arguments]
            runpy.run_module("finetune", run_name="__main__")
            status = 0
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else 1
        finally:
            with open(record, "w") as file:
                json.dump(sorted(sys.modules), file)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"finetune {' '.join(arguments)} exited with {os.waitstatus_to_exitcode(status)}")
"""


def loaded_modules_of(tmp_path: Path, commands: dict[str, list[str]]) -> dict[str, set[str]]:
    """name -> the modules loaded by `finetune ARGUMENTS...` (each command forked from one interpreter
    that loaded only torch and transformers), read when it exits."""
    records = {name: tmp_path / f"modules-{index}.json" for index, name in enumerate(commands)}
    listed = [[str(records[name]), *arguments] for name, arguments in commands.items()]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    completed = subprocess.run(
        [sys.executable, "-c", _RECORD_MODULES, json.dumps(listed), json.dumps(TRAINING_ONLY)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-2000:]
    return {name: set(json.loads(record.read_text())) for name, record in records.items()}


def training_modules(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in TRAINING_ONLY))


def test_help_loads_neither_torch_nor_the_recipe_schema():
    """`finetune --help` (and argument errors) answer before any heavy import: torch and transformers are
    imported inside handlers, and the recipe schema (pydantic, a quarter of a second) on first use."""
    code = (
        "import json, runpy, sys\n"
        "sys.argv = ['finetune', '--help']\n"
        "try:\n    runpy.run_module('finetune', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    completed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                               capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    modules = set(json.loads(completed.stdout.splitlines()[-1]))
    assert "finetune.cli" in modules and "finetune.commands.train" in modules  # it built the whole parser
    heavy = ("torch", "transformers", "pydantic", "finetune.recipe", "yaml")
    assert sorted(m for m in modules if m.split(".")[0] in heavy or m == "finetune.recipe") == []


def test_dir_lists_the_lazy_api_without_importing_it():
    """A notebook's tab completion of `finetune.` reads `dir(finetune)`: it must offer `train` and `load_model`
    (exported lazily, PEP 562) before they were first used, and listing them must not import torch."""
    code = "import json, sys, finetune; print(json.dumps([dir(finetune), 'torch' in sys.modules]))"
    completed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                               capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    names, torch_imported = json.loads(completed.stdout)
    assert {"train", "load_model", "load_recipe", "Recipe", "RecipeError", "__version__"} <= set(names)
    assert not torch_imported


def test_importing_the_api_loads_no_training(tmp_path):
    code = "import json, sys, finetune.api; print(json.dumps(sorted(sys.modules)))"
    completed = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                               capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    modules = set(json.loads(completed.stdout))
    assert "finetune.adapters.inmemory" in modules and "transformers" in modules  # it imported what inference needs
    assert training_modules(modules) == []
    # nor the embedded base's build (its pretraining loop): resolving `embedded:` names needs its settings only
    assert {"finetune.embedded.build", "finetune.embedded.pretrain"} & modules == set()


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
    loaded = loaded_modules_of(tmp_path, commands)
    assert "finetune.scoring" in loaded["eval"] and "finetune.generation.light_model" in loaded["generate"]
    assert (tmp_path / "merged").is_dir()
    assert {name: training_modules(modules) for name, modules in loaded.items()} == {name: [] for name in commands}


def test_training_an_unquantized_base_loads_no_bitsandbytes_or_deepspeed(workdir):
    """bitsandbytes (which imports torch's inductor) only for a 4-/8-bit base or an 8-bit optimizer, deepspeed only
    for its strategy: seconds of every training process's start (transformers' scheduler module imported peft,
    and with it bitsandbytes, before finetune could hide it)."""
    modules = loaded_modules_of(workdir, {"train": ["train", "recipe.yaml", "train.max_steps=1", "output.name=one"]})[
        "train"
    ]
    assert "finetune.training.loop" in modules and (workdir / "adapters" / "one").is_dir()  # it trained
    assert sorted(m for m in modules if m.split(".")[0] in ("bitsandbytes", "deepspeed")) == []
