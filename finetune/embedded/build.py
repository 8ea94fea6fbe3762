"""How an embedded base is made: corpus → tokenizer → tiny Llama → brief pretraining → model directory.

`EMBEDDED_BASES` names every embedded base and the settings it is built from. `build_embedded_base`
writes a normal Hugging Face model directory (config.json, model.safetensors, generation_config.json,
tokenizer files) plus `embedded.json`, a record of how it was built. The same settings on the same
Python and torch give the same weights, bit for bit. Where the directory lives and when it is (re)built
is `finetune.embedded`'s job.

Example:
    record = build_embedded_base(Path("/tmp/tiny"), EMBEDDED_BASES["tiny-llama"], progress=print)
    record["pretraining"]["final_loss"]
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers.utils import logging as hf_logging

from finetune.embedded.corpus import stdlib_corpus
from finetune.embedded.pretrain import PretrainSettings, pretrain, token_rows
from finetune.embedded.tiny import TINY_LLAMA_SHAPE, build_tiny_llama
from finetune.embedded.tokenizer import train_tokenizer

BUILD_FORMAT_VERSION = 1
"""Bump when the build code changes what it produces, so cached bases are rebuilt (new directory name)."""

RECORD_FILE = "embedded.json"


@dataclass(frozen=True)
class BuildSettings:
    """Everything an embedded base is built from; its cache directory name is derived from these."""

    corpus_max_bytes: int
    """Standard-library source read for the tokenizer and for pretraining, in UTF-8 bytes."""
    corpus_file_max_bytes: int
    """At most this many bytes from any one source file."""
    vocab_size: int
    seq_len: int
    """Pretraining row length in tokens."""
    pretraining: PretrainSettings
    shape: dict[str, int | bool] = field(default_factory=lambda: dict(TINY_LLAMA_SHAPE))
    """`LlamaConfig` fields; every linear out_features a multiple of 32 (bitsandbytes' CPU 4-bit)."""
    init_seed: int = 0
    num_threads: int | None = None
    """torch threads for pretraining; None uses every CPU this process may run on. Part of the settings
    because it changes the weights: a different thread count sums in a different order, and 600 steps
    amplify that (1 vs 2 threads differed by up to 0.34 in a weight). A fixed count builds the same base
    on any machine with the same CPU kernels. The default uses 1: on 2 busy cores a 2-thread build took
    6x longer than a 1-thread one (threads spin-waiting for each other); on idle ones 2 threads would be
    about 1.5x faster."""


EMBEDDED_BASES: dict[str, BuildSettings] = {
    "tiny-llama": BuildSettings(
        corpus_max_bytes=2_000_000,
        corpus_file_max_bytes=8_000,
        vocab_size=2048,
        seq_len=128,
        pretraining=PretrainSettings(steps=500, micro_batch_size=8, lr=3e-3, warmup_steps=30),
        num_threads=1,
    ),
}
"""The embedded bases a recipe can name as `embedded:<name>`."""


def settings_record(settings: BuildSettings) -> dict:
    """The settings as plain JSON-able data (also what the cache directory name is hashed from)."""
    return asdict(settings)


def _available_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _save_quietly(model: transformers.PreTrainedModel, tokenizer, out_dir: Path) -> None:
    """`save_pretrained` of model (safetensors, config.json, generation_config.json) and tokenizer."""
    progress_bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar says nothing in our log
    try:
        model.save_pretrained(out_dir)
    finally:
        if progress_bar_was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out_dir)


def build_embedded_base(
    out_dir: Path,
    settings: BuildSettings,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """Build a base into `out_dir` (which must exist and be empty) and return its build record.

    Args:
        out_dir: the directory to write; `finetune.embedded.cache` passes a temporary one and renames it.
        settings: corpus size, tokenizer, shape and pretraining.
        progress: called with one-line progress messages.
    """
    start_seconds = time.perf_counter()
    corpus = stdlib_corpus(settings.corpus_max_bytes, settings.corpus_file_max_bytes)
    progress(f"corpus: {corpus.num_files} files, {corpus.num_bytes / 1e6:.1f} MB of {corpus.source}")

    tokenizer = train_tokenizer(
        corpus.documents, vocab_size=settings.vocab_size, max_model_len=int(settings.shape["max_position_embeddings"])
    )
    rows = token_rows(tokenizer, corpus.documents, settings.seq_len)  # (num_rows, seq_len)
    tokenizer_seconds = time.perf_counter() - start_seconds
    progress(f"tokenizer: {len(tokenizer)} tokens; corpus is {rows.numel():,} tokens ({tokenizer_seconds:.0f} s)")

    model = build_tiny_llama(tokenizer, seed=settings.init_seed, **settings.shape)
    num_params = sum(p.numel() for p in model.parameters())
    progress(f"model: {num_params / 1e6:.2f}M parameters; pretraining for {settings.pretraining.steps} steps")
    num_threads = settings.num_threads or _available_cpu_count()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        result = pretrain(model, rows, settings.pretraining, progress)
    finally:
        torch.set_num_threads(threads_before)

    _save_quietly(model, tokenizer, out_dir)
    record = {
        "format_version": BUILD_FORMAT_VERSION,
        "settings": settings_record(settings),
        "corpus": {
            "source": corpus.source,
            "files": corpus.num_files,
            "bytes": corpus.num_bytes,
            "tokens": rows.numel(),
            "sha256": corpus.sha256,
        },
        "parameters": num_params,
        "pretraining": asdict(result),
        "seconds": round(time.perf_counter() - start_seconds, 2),
        "threads": num_threads,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    (out_dir / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
