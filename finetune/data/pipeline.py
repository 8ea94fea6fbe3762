"""The data pipeline end to end: sources → documents → (validation split) → rows, cached on disk.

Steps, each in its own module: `sources` reads records, `formats` turns each into token ids and labels,
this module applies `data.overlength`, drops records with nothing to train on, holds out validation
data, and `packing` builds the rows; `cache` keys the result by the data fingerprint so a second run
with the same inputs loads it instead of tokenizing again.

Validation data is `data.validation` when given, else a seeded `data.validation_split` fraction of the
training documents (taken before packing, so no held-out document shares a row with a trained one), else
none.

Example:
    bundle = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=print)
    bundle.train[0].keys()   # input_ids, labels, position_ids
    bundle.stats["num_label_tokens"]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedTokenizerBase

from finetune.data import cache
from finetune.data.formats import Document, Locate, encode_records
from finetune.data.packing import arrow_dataset, build_rows, document_lengths
from finetune.data.sources import RawSource, iter_records, load_source
from finetune.errors import DataError
from finetune.loss import IGNORE_INDEX
from finetune.recipe import DataConfig, SourceConfig

Log = Callable[[str], None]

DOCUMENT_FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("int32")),
        "truncated": datasets.Value("bool"),
    }
)
_RECORDS_PER_CHUNK = 1000


@dataclass(frozen=True)
class DataBundle:
    """What the training loop gets from the data pipeline.

    Attributes:
        train: rows with `input_ids`, `labels`, `position_ids` (lists of int).
        validation: rows with the same columns, or None when there is no validation data.
        fingerprint: `sha256:...` over source bytes, the relevant data config and the tokenizer identity.
        stats: counts (ints) for the training rows: num_records (documents kept), num_rows, num_tokens,
            num_label_tokens, num_truncated (kept documents cut to max_seq_len), num_dropped (records with
            nothing to train on, counted over all sources), and the same with a `validation_` prefix when
            there is validation data.
        cache_hit: True when the rows were loaded from the cache and nothing was tokenized.
        cache_path: the cache entry the rows are memory-mapped from; None with `use_cache=False`.
    """

    train: datasets.Dataset
    validation: datasets.Dataset | None
    fingerprint: str
    stats: dict[str, Any]
    cache_hit: bool
    cache_path: Path | None


def _no_log(message: str) -> None:
    pass


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide `datasets`' progress bars (flattening, saving) while we log our own one-line summaries."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def build_datasets(
    config: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    log: Log = _no_log,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> DataBundle:
    """Read, tokenize, split and pack the data of a recipe, or load the result of an earlier run.

    Args:
        config: the recipe's `data` section.
        tokenizer: the base model's tokenizer (its identity is part of the fingerprint).
        seed: seeds the validation split (`train.seed`); unused without `validation_split`.
        log: receives one-line progress messages.
        cache_dir: where tokenized rows are cached; default `$HF_DATASETS_CACHE/finetune`.
        use_cache: False builds in memory and writes nothing (for one-off inspection).

    Raises:
        DataError: a source is missing, unreadable or empty, or a record does not fit the format.
    """
    inputs = cache.fingerprint_inputs(config, tokenizer, seed)
    fingerprint = cache.fingerprint_of(inputs)
    cache_root = Path(cache_dir) if cache_dir is not None else cache.default_cache_root()
    if use_cache and (entry := cache.load_cached(cache_root, fingerprint)) is not None:
        log(f"data: {entry.stats['num_rows']} training rows loaded from cache {entry.path} (no tokenizing)")
        return DataBundle(entry.train, entry.validation, fingerprint, entry.stats, True, entry.path)

    with _quiet_datasets():
        train, validation, stats = _build(config, tokenizer, seed, log)
        if not use_cache:
            return DataBundle(train, validation, fingerprint, stats, False, None)
        path = cache.store(cache_root, fingerprint, train, validation, stats, inputs)
    entry = cache.load_cached(cache_root, fingerprint)
    assert entry is not None, f"cache entry {path} unreadable right after writing it"
    log(f"data: rows cached in {path}")
    return DataBundle(entry.train, entry.validation, fingerprint, entry.stats, False, entry.path)


def preview_documents(config: DataConfig, tokenizer: PreTrainedTokenizerBase, limit: int) -> list[Document]:
    """The first `limit` training records of the first source as training sees them (template, length, mask).

    Records with nothing to train on are skipped (as training drops them); nothing is cached or packed.
    """
    raw = load_source(config.train[0], config.text_field)
    documents: list[Document] = []
    for first, records in iter_records(raw, max(limit, 1)):
        encoded = encode_records(records, config, tokenizer, locate=_locator(raw, first))
        for offset, document in enumerate(encoded):
            fitted, _ = _fit_to_length(document, config, raw.where(first + offset))
            if fitted is not None:
                documents.append(fitted)
            if len(documents) == limit:
                return documents
    return documents


def _build(config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int,
                log: Log) -> tuple[datasets.Dataset, datasets.Dataset | None, dict[str, Any]]:
    """Training rows, validation rows (or None) and their stats, built from the sources."""
    train_docs, num_dropped = _documents(config.train, config, tokenizer, log)
    if config.validation:
        validation_docs, num_validation_dropped = _documents(config.validation, config, tokenizer, log)
    elif config.validation_split > 0:
        train_docs, validation_docs = _split(train_docs, config.validation_split, seed)
        num_validation_dropped = 0
        log(f"data: held out {len(validation_docs)} of {len(train_docs) + len(validation_docs)} training records "
            f"for validation (validation_split={config.validation_split}, seed={seed})")
    else:
        validation_docs, num_validation_dropped = None, 0

    train = build_rows(train_docs, config.max_seq_len, config.packing)
    stats = {**_stats(train_docs, train), "num_dropped": num_dropped}
    validation = None
    if validation_docs is not None:
        validation = build_rows(validation_docs, config.max_seq_len, config.packing)
        stats.update({f"validation_{key}": value for key, value in _stats(validation_docs, validation).items()})
        stats["validation_num_dropped"] = num_validation_dropped
    filled = stats["num_tokens"] / (stats["num_rows"] * config.max_seq_len)
    layout = f"packed, {filled:.1%} of {config.max_seq_len} tokens filled" if config.packing else "one document each"
    log(f"data: {stats['num_records']} documents, {stats['num_tokens']} tokens ({stats['num_label_tokens']} "
        f"trained) in {stats['num_rows']} rows ({layout})")
    return train, validation, stats


def _locator(raw: RawSource, first: int) -> Locate:
    """Names record `i` of a chunk that starts at record `first` of `raw`, for error messages."""
    return lambda i: raw.where(first + i)


def _documents(sources: list[SourceConfig], config: DataConfig, tokenizer: PreTrainedTokenizerBase,
               log: Log) -> tuple[datasets.Dataset, int]:
    """All documents of `sources`, in order, cut or refused by `overlength`; and how many were dropped."""
    chunks, num_records, num_dropped, num_truncated = [], 0, 0, 0
    for source in sources:
        raw = load_source(source, config.text_field)
        num_records += len(raw.records)
        for first, records in iter_records(raw, _RECORDS_PER_CHUNK):
            encoded = encode_records(records, config, tokenizer, locate=_locator(raw, first))
            chunk: dict[str, list] = {"input_ids": [], "labels": [], "truncated": []}
            for offset, document in enumerate(encoded):
                document, truncated = _fit_to_length(document, config, raw.where(first + offset))
                num_truncated += truncated
                if document is None:
                    num_dropped += 1
                    continue
                chunk["input_ids"].append(document.input_ids)
                chunk["labels"].append(document.labels)
                chunk["truncated"].append(truncated)
            chunks.append(pa.table(chunk, schema=DOCUMENT_FEATURES.arrow_schema))
        log(f"data: tokenized {len(raw.records)} records from {source.path}")
    where = ", ".join(source.path for source in sources)
    if num_dropped:
        log(f"data: dropped {num_dropped} of {num_records} records with nothing to train on "
            f"(empty text, no assistant turn, or a prompt filling all of max_seq_len)")
    if num_truncated:
        log(f"data: truncated {num_truncated} of {num_records} records to max_seq_len={config.max_seq_len} tokens")
    documents = arrow_dataset(pa.concat_tables(chunks))
    if len(documents) == 0:
        raise DataError(f"no usable records in {where}: all {num_records} were dropped (empty text, or nothing to "
                        f"train on, e.g. no assistant turn); check data.format and the field names")
    return documents, num_dropped


def _fit_to_length(document: Document | None, config: DataConfig, where: str) -> tuple[Document | None, bool]:
    """`data.overlength` applied: (the document, or None when no trained label is left; whether it was cut)."""
    if document is None or len(document.input_ids) <= config.max_seq_len:
        return document, False
    if config.overlength == "error":
        raise DataError(f"{where}: {len(document.input_ids)} tokens, longer than data.max_seq_len="
                        f"{config.max_seq_len}; raise data.max_seq_len, shorten the record, or set "
                        f"data.overlength=truncate")
    labels = document.labels[: config.max_seq_len]
    if all(label == IGNORE_INDEX for label in labels):
        return None, True
    return Document(document.input_ids[: config.max_seq_len], labels), True


def _split(documents: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation): a seeded random `fraction` of the documents held out, both kept in record order."""
    num_validation = max(1, round(fraction * len(documents)))
    if num_validation >= len(documents):
        raise DataError(f"data.validation_split={fraction} of {len(documents)} records leaves none for training; "
                        f"lower it, add data, or give data.validation sources")
    order = np.random.default_rng(seed).permutation(len(documents))
    held_out, kept = np.sort(order[:num_validation]), np.sort(order[num_validation:])
    table = documents.data.table
    return arrow_dataset(table.take(kept)), arrow_dataset(table.take(held_out))


def _stats(documents: datasets.Dataset, rows: datasets.Dataset) -> dict[str, int]:
    labels = pc.list_flatten(documents.data.column("labels"))
    return {
        "num_records": len(documents),
        "num_rows": len(rows),
        "num_tokens": int(sum(document_lengths(documents))),
        "num_label_tokens": int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0),
        "num_truncated": int(pc.sum(documents.data.column("truncated")).as_py() or 0),
    }
