"""Shared fixtures: tiny Llama bases built locally from a config, never downloaded.

Every fixture that writes a model saves it with `save_pretrained`, so the code under test loads it back
through the real `from_pretrained` path, exactly as it would load a hub model.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Offline before transformers/datasets are imported anywhere in the session.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Caches (tokenized data, fingerprints, the embedded base) go to a scratch directory, not the user's
# ~/.cache, so every session starts as a fresh machine would (subprocesses inherit it).
_SCRATCH_CACHE = tempfile.mkdtemp(prefix="finetune-tests-cache-")
atexit.register(shutil.rmtree, _SCRATCH_CACHE, ignore_errors=True)
os.environ["HF_DATASETS_CACHE"] = os.path.join(_SCRATCH_CACHE, "datasets")
os.environ["FINETUNE_HOME"] = os.path.join(_SCRATCH_CACHE, "finetune")

from pathlib import Path

import pytest

from finetune.embedded.tiny import build_tiny_llama
from finetune.embedded.tokenizer import train_tokenizer

# Small enough that a training step takes milliseconds; every linear out_features is a multiple of 32.
TEST_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def _tokenizer_corpus() -> list[str]:
    words = (
        "the model reads a document and predicts the next token while the adapter learns a low rank "
        "update of the frozen weight matrix for the domain in question with loss on response tokens"
    ).split()
    lines = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    code = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * 2)\n"]
    return (lines + code) * 20


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 512-token byte-level BPE tokenizer with distinct BOS/EOS/PAD and a chat template."""
    return train_tokenizer(_tokenizer_corpus(), vocab_size=512, max_model_len=512)


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved random-init tiny Llama (float32) with its tokenizer: a local 'hub' model directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_llama(tiny_tokenizer, seed=0, **TEST_SHAPE).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


# Fixtures defined beside the tests that use them most, shared with the rest of the suite from here.
from adapter_fixtures import adapter_dirs  # noqa: F401
from run_fixtures import trained_runs  # noqa: F401
from test_train import workdir  # noqa: F401
