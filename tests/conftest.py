"""Shared fixtures: tiny Llama bases built locally from a config, never downloaded.

Every fixture that writes a model saves it with `save_pretrained`, so the code under test loads it back
through the real `from_pretrained` path, exactly as it would load a hub model.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

# Offline before transformers/datasets are imported anywhere in the session.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist every worker (and the processes its tests start) computes on one thread: the workers
# already fill the cores, and more threads than cores slow everything down. Set before torch loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
# Caches (tokenized data, fingerprints, the embedded base) go to a scratch directory, not the user's
# ~/.cache, so every session starts as a fresh machine would (subprocesses inherit it).
_SCRATCH_CACHE = tempfile.mkdtemp(prefix="finetune-tests-cache-")
atexit.register(shutil.rmtree, _SCRATCH_CACHE, ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = os.path.join(_SCRATCH_CACHE, "datasets")
os.environ["FINETUNE_HOME"] = os.path.join(_SCRATCH_CACHE, "finetune")

from pathlib import Path

import pytest
from helpers import TEST_SHAPE, instruction_records, tokenizer_corpus

from finetune.embedded.tiny import build_tiny_llama
from finetune.embedded.tokenizer import train_tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 512-token byte-level BPE tokenizer with distinct BOS/EOS/PAD and a chat template."""
    return train_tokenizer(tokenizer_corpus(), vocab_size=512, max_model_len=512)


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved random-init tiny Llama (float32) with its tokenizer: a local 'hub' model directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(tiny_tokenizer, seed=0, **TEST_SHAPE).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def workdir(tmp_path, monkeypatch, tiny_base_dir):
    """A working directory holding train/valid data and a recipe on the tiny base; cwd is set to it."""
    monkeypatch.chdir(tmp_path)
    records = instruction_records(48)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:40]))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[40:]))
    (tmp_path / "recipe.yaml").write_text(
        f"""
model:
  base: {tiny_base_dir}
lora:
  r: 4
  alpha: 8
  dropout: 0.1
data:
  train: train.jsonl
  validation: valid.jsonl
  format: instruction
  max_seq_len: 128
train:
  max_steps: 6
  micro_batch_size: 4
  grad_accum_steps: 2
  lr: 0.005
  warmup_steps: 1
  log_every_steps: 2
output:
  name: crates
"""
    )
    return tmp_path


def pytest_xdist_auto_num_workers(config):
    """`-n auto` starts one worker more than the cores: many tests wait on a subprocess that sleeps between steps,
    on a launcher, on a signal or on a server, and the extra worker fills those waits. On 2 Intel Xeon cores the
    suite took 9 min 25 s with 3 workers against 10 min 46 s with 2 (a heavier run: one launch more)."""
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(config, items):
    """The quickstart's tests run first; `gpu`-marked tests skip where no CUDA device is visible, saying so.

    The quickstart chain (its training, then the DPO quickstart on its adapter, about 5 minutes at one thread) is
    the longest run of tests that must follow one another; started first, it ends while the other workers share
    the rest (xdist's worksteal gives the first worker the first tests and lets the others take its last ones).
    """
    items.sort(key=lambda item: item.path.name != "test_quickstart.py")  # stable: the rest keep their order
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none is visible here); bench/gpu_check.sh runs these on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Fixtures kept in their own modules (fixture modules, not test modules), shared with the suite from here.
from adapter_fixtures import adapter_dirs  # noqa: F401
from run_fixtures import trained_runs  # noqa: F401
