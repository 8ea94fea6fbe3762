"""The data fingerprint, and an on-disk cache of tokenized rows keyed by it.

Why an explicit cache rather than `datasets`' own `.map` cache: `.map` caches only datasets that are
already backed by Arrow files, keys them by hashing the mapped function (a closure over a tokenizer hashes
slowly and, when it cannot, silently falls back to a random key), and still re-reads and re-parses the
sources on every run. Here the key is computed from what decides the result and nothing else:

- the bytes of every source (in order; with split, subset and max_records), not their paths, so moving
  data keeps the cache (a hub dataset's snapshot holds every subset's files, so its bytes alone do not
  say which subset was read);
- the data config fields the chosen format reads (e.g. `text_field` only for `text`), max_seq_len,
  overlength, and the validation split with its seed only when a split is taken (not `packing`: rows
  are one document each, packed per micro-batch when collated);
- the tokenizer's identity: its full serialisation (vocabulary, merges, normalisers), special tokens and
  chat template;
- `PIPELINE_VERSION`, bumped whenever this package changes what it produces.

An entry is a directory: `train/data.arrow` (and `validation/data.arrow`), Arrow stream files as
`datasets` writes them, and `meta.json` (stats and fingerprint inputs). A hit memory-maps the rows with
`datasets.Dataset.from_file` and tokenizes nothing. A miss builds the rows straight into a temporary
directory beside the cache entry, batch by batch (see `finetune.data.rowfiles`), and renames it into
place, so a crash never leaves a half-written entry and two processes racing to write the same entry both end up reading one
complete copy; the staging directory of a killed build is removed by the next build (`remove_abandoned_staging`).
The cache lives in `$HF_DATASETS_CACHE/finetune` (next to `datasets`' own cache, moved by the same
variables) unless a directory is passed in. Entries are never evicted: each distinct data fingerprint
keeps one directory of Arrow files until the directory is deleted (always safe to do).

Example:
    fingerprint = data_fingerprint(config, tokenizer, seed=0)   # "sha256:3f1c..."
    entry = load_cached(cache_root, fingerprint)                  # None on a miss
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from finetune.atomic import WRITE_FAILURES, process_alive, unwritable_as
from finetune.data.sources import source_content_hash
from finetune.errors import OutputError
from finetune.recipe import DataConfig, SourceConfig

# 11: a system prompt the template leaves out of answered conversations folded into the first user turn
# (Mistral v0.3); 10: prompt records with a column named as a reward function's argument refused; 9: a note on
# records whose reasoning the template renders in no turn; 8: chat masks after blank or context tool results,
# `developer` as `system`; 7: BOS/EOS never doubled where the text already has them; 6: lines split at CR/LF only
PIPELINE_VERSION = 11
"""Bump when the rows this package produces change for the same inputs; old cache entries are then unused."""

_FORMAT_FIELDS = {
    "text": ("text_field",),
    "instruction": (
        "prompt_field",
        "input_field",
        "response_field",
        "prompt_template",
        "prompt_with_input_template",
        "completion_only_loss",
    ),
    "chat": ("messages_field", "tools_field", "chat_template", "completion_only_loss", "reasoning"),
    "preference": ("tools_field", "chat_template", "reasoning"),
    "unpaired_preference": ("tools_field", "chat_template", "reasoning"),
    "prompt": ("tools_field", "chat_template", "reasoning"),
}
_ROW_FIELDS = ("format", "max_seq_len", "overlength")


def default_cache_root() -> Path:
    """`$HF_DATASETS_CACHE/finetune`: beside `datasets`' cache, so its environment variables move both."""
    return Path(datasets.config.HF_DATASETS_CACHE) / "finetune"


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of what decides how the tokenizer encodes: its full serialisation and special tokens."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Truncation and padding are call-time state that transformers leaves behind in the backend after
        # a call like tokenizer(..., truncation=True); they do not change how text maps to ids.
        serialised = json.loads(backend.to_str())
        serialised.pop("truncation", None)
        serialised.pop("padding", None)
        digest.update(json.dumps(serialised, sort_keys=True).encode())
    else:  # a slow tokenizer: its vocabulary stands in for the model file
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "chat_template": tokenizer.chat_template,
    }
    digest.update(json.dumps(special, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def fingerprint_inputs(config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> dict[str, Any]:
    """Everything the rows depend on, as a JSON-able mapping (hashed by `data_fingerprint`)."""
    fields = {name: getattr(config, name) for name in (*_ROW_FIELDS, *_FORMAT_FIELDS[config.format])}
    if not config.validation and config.validation_split > 0:
        fields["validation_split"] = config.validation_split
        fields["seed"] = seed

    def describe(sources):
        return [_describe_source(source) for source in sources]

    return {
        "pipeline_version": PIPELINE_VERSION,
        "config": fields,
        "train": describe(config.train),
        "validation": describe(config.validation),
        "tokenizer": tokenizer_identity(tokenizer),
    }


def _describe_source(source: SourceConfig) -> dict[str, Any]:
    """What of one source decides its records. `subset` picks files within a hub snapshot whose bytes are
    hashed whole, so two subsets of one snapshot differ only there; it is named only when set, so the keys
    of sources without one (every local file) stay those written before it was added."""
    described = {"sha256": source_content_hash(source), "split": source.split, "max_records": source.max_records}
    if source.subset is not None:
        described["subset"] = source.subset
    return described


def fingerprint_of(inputs: dict[str, Any]) -> str:
    """`sha256:<hex>` of `fingerprint_inputs(...)`: the data fingerprint."""
    return "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def data_fingerprint(config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> str:
    """`sha256:<hex>` over the source bytes, the config fields that matter and the tokenizer identity."""
    return fingerprint_of(fingerprint_inputs(config, tokenizer, seed))


@dataclass(frozen=True)
class CacheEntry:
    """Rows and stats of one fingerprint, as stored on disk."""

    train: datasets.Dataset
    validation: datasets.Dataset | None
    stats: dict[str, Any]
    path: Path


def _entry_dir(cache_root: Path, fingerprint: str) -> Path:
    return cache_root / fingerprint.removeprefix("sha256:")


ROWS_FILE = "data.arrow"


def rows_file(entry: Path, split: str) -> Path:
    """Where the rows of `split` (`train`, `validation`) are in an entry directory (or its staging copy)."""
    return entry / split / ROWS_FILE


def load_rows(entry: Path, split: str, in_memory: bool = False) -> datasets.Dataset:
    """The rows of `split` in `entry`, memory-mapped (or read into memory with `in_memory`)."""
    return datasets.Dataset.from_file(str(rows_file(entry, split)), in_memory=in_memory)


def load_cached(cache_root: Path, fingerprint: str) -> CacheEntry | None:
    """The entry for `fingerprint`, memory-mapped, or None when there is none (or it is damaged)."""
    path = _entry_dir(cache_root, fingerprint)
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        train = load_rows(path, "train")
        validation = load_rows(path, "validation") if meta["has_validation"] else None
        whole = len(train) == meta["stats"]["num_rows"] and (
            validation is None or len(validation) == meta["stats"]["validation_num_rows"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged by hand: rebuilt and replaced by the caller
    # An Arrow stream cut at a record batch boundary (a file truncated or copied in part; writes are not
    # synced before the rename) reads without an error as fewer rows: the counts in meta.json tell.
    return CacheEntry(train, validation, meta["stats"], path) if whole else None


Build = Callable[[Path], "tuple[dict[str, Any], bool]"]
"""Writes the rows into a directory (`rows_file(directory, split)`); returns (stats, has_validation)."""


def store(cache_root: Path, fingerprint: str, build: Build, inputs: dict[str, Any]) -> Path:
    """Build an entry in a temporary directory, then rename it into place atomically; return its path.

    `build` runs inside the staging directory, so rows stream to disk as they are made and are never
    held in memory whole; if it raises, the staging directory is removed and nothing is cached.
    """
    with unwritable_as(OutputError, cache_root, elsewhere=_ELSEWHERE):  # read-only, no permission: one line
        cache_root.mkdir(parents=True, exist_ok=True)
    # a full disk while rows are written: one line, not pyarrow's traceback (the build's own reads keep their errors)
    with unwritable_as(OutputError, cache_root, elsewhere=_ELSEWHERE, only=WRITE_FAILURES):
        return _store(cache_root, fingerprint, build, inputs)


_ELSEWHERE = " (or set HF_DATASETS_CACHE to move the tokenized-data cache)"


def _store(cache_root: Path, fingerprint: str, build: Build, inputs: dict[str, Any]) -> Path:
    path = _entry_dir(cache_root, fingerprint)  # cache_root was made by `store`
    remove_abandoned_staging(cache_root)
    staging = cache_root / f".tmp-{path.name[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{socket.gethostname()}"
    try:
        staging.mkdir()
        stats, has_validation = build(staging)
        meta = {"fingerprint": fingerprint, "has_validation": has_validation, "stats": stats, "inputs": inputs}
        (staging / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
        if path.exists():
            if load_cached(cache_root, fingerprint) is not None:
                return path  # another process wrote the same entry first: keep theirs, it may be in use
            damaged = cache_root / f".damaged-{uuid.uuid4().hex[:8]}"
            os.rename(path, damaged)
            shutil.rmtree(damaged, ignore_errors=True)
        try:
            os.rename(staging, path)
        except OSError:
            if load_cached(cache_root, fingerprint) is None:
                raise  # not a lost race: a real failure to write the cache
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def remove_abandoned_staging(cache_root: Path) -> None:
    """Delete the staging directories of builds whose process is gone (SIGKILL, or SIGTERM before training
    installs its handler), and `.damaged-*` entries a kill left before their removal.

    A build removes its own staging directory when it fails, but a killed process runs no cleanup, and
    each kill during tokenizing left up to the whole tokenized corpus under a hidden name for good. A
    staging directory names its process and host (`.tmp-<fingerprint>-<pid>-<random>-<host>`); only those
    of this host whose process no longer exists are removed, so a build running now, here or on another
    machine sharing the cache, keeps its own.
    """
    host = socket.gethostname()
    for child in cache_root.glob(".damaged-*"):
        shutil.rmtree(child, ignore_errors=True)
    for child in cache_root.glob(".tmp-*"):
        parts = child.name.split("-", 4)
        if len(parts) == 5 and parts[4] == host and parts[2].isdigit() and not process_alive(int(parts[2])):
            shutil.rmtree(child, ignore_errors=True)
