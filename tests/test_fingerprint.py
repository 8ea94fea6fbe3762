"""Base fingerprints: a directory and the model loaded from it agree; layout, sharding and LoRA don't matter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TEST_SHAPE
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from finetune import fingerprint
from finetune.embedded.tiny import build_tiny_llama
from finetune.fingerprint import fingerprint_model, fingerprint_model_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_HOME", str(tmp_path / "cache"))
    fingerprint._memory_cache.clear()


@pytest.mark.parametrize("tied", [True, False])
def test_model_and_its_directory_agree(tmp_path, tiny_tokenizer, tied):
    model = build_tiny_llama(tiny_tokenizer, seed=1, tie_word_embeddings=tied, **TEST_SHAPE)
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    expected = fingerprint_model_dir(tmp_path / "m")
    assert expected.startswith("sha256:") and len(expected) == len("sha256:") + 64
    assert fingerprint_model(model) == expected
    assert fingerprint_model(loaded) == expected


def test_sharding_does_not_change_it(tmp_path, tiny_base_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    assert fingerprint_model_dir(tmp_path / "sharded") == fingerprint_model_dir(tiny_base_dir)


def test_content_dtype_and_seed_change_it(tmp_path, tiny_tokenizer, tiny_base_dir):
    build_tiny_llama(tiny_tokenizer, seed=7, **TEST_SHAPE).save_pretrained(tmp_path / "other")
    assert fingerprint_model_dir(tmp_path / "other") != fingerprint_model_dir(tiny_base_dir)
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.bfloat16)
    assert fingerprint_model(bf16) != fingerprint_model_dir(tiny_base_dir)
    bf16.save_pretrained(tmp_path / "bf16")
    assert fingerprint_model(bf16) == fingerprint_model_dir(tmp_path / "bf16")


def test_peft_wrapped_model_fingerprints_its_base(tiny_base_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert fingerprint_model(peft_model) == fingerprint_model_dir(tiny_base_dir)


def test_directory_result_is_cached_by_path_size_and_mtime(tmp_path, tiny_base_dir, monkeypatch):
    first = fingerprint_model_dir(tiny_base_dir)
    cached = list((tmp_path / "cache" / "fingerprints").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["entries"]
    fingerprint._memory_cache.clear()

    def no_hashing(tensor):
        raise AssertionError("hashed again despite the on-disk cache")

    monkeypatch.setattr(fingerprint, "_tensor_digest", no_hashing)
    assert fingerprint_model_dir(tiny_base_dir) == first


def test_large_tensors_hash_like_small_ones(monkeypatch):
    tensor = torch.randn(300, 70)
    whole = fingerprint._tensor_digest(tensor)
    monkeypatch.setattr(fingerprint, "_BYTES_PER_READ", 1000)  # forces the row-sliced path
    assert fingerprint._tensor_digest(tensor) == whole


def test_directory_without_weights_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        fingerprint_model_dir(tmp_path)


FINGERPRINT_ON_A_FULL_DISK = """
import resource, signal, sys
from finetune.fingerprint import fingerprint_model_dir
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))  # the cache entry (a line per tensor) stops midway
print(fingerprint_model_dir(sys.argv[1]))
"""


def test_a_full_disk_under_the_fingerprint_cache_leaves_no_part_written(tmp_path, tiny_base_dir):
    """The per-file cache entry is written to a `.tmp<pid>` file and renamed; a full disk (a write failing midway)
    left that part behind at every run, never read and never removed. The fingerprint is still computed."""
    env = {**os.environ, "FINETUNE_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", FINGERPRINT_ON_A_FULL_DISK, str(tiny_base_dir)], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("sha256:"), result.stderr
    assert [p.name for p in (tmp_path / "home").rglob("*") if p.is_file()] == []
