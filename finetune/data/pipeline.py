"""The data pipeline end to end: sources → documents → (validation split) → rows, cached on disk.

Steps, each in its own module: `sources` reads records, `formats` turns each into token ids and labels,
`overlength` splits or truncates records longer than max_seq_len, this module drops records with nothing
to train on and holds out validation data; `cache` keys the result by the data fingerprint so a second
run with the same inputs loads it instead of tokenizing again.

A row of the result is one document (a record, or one piece of a split record). Rows are not packed
here: packing groups the documents of each micro-batch when it is collated (`collate`), so a batch is
the same documents packed or not and packing changes speed only.

Validation data is `data.validation` when given, else a seeded `data.validation_split` fraction of the
training records (all pieces of a split record on the same side), else none.

Example:
    bundle = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=print)
    bundle.train[0].keys()   # input_ids, labels
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
from finetune.data.overlength import fit_to_length
from finetune.data.packing import arrow_dataset, document_lengths, document_rows
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
        "record": datasets.Value("int64"),
    }
)
"""Documents before rows: `truncated` marks a cut record, `record` numbers records across the sources (the
pieces of a split record share it)."""
_RECORDS_PER_CHUNK = 1000


@dataclass(frozen=True)
class DataBundle:
    """What the training loop gets from the data pipeline.

    Attributes:
        train: one document per row: `input_ids`, `labels` (lists of int).
        validation: rows with the same columns, or None when there is no validation data.
        fingerprint: `sha256:...` over source bytes, the relevant data config and the tokenizer identity.
        stats: counts (ints) for the training rows: num_records (records kept), num_rows (documents: records
            and pieces of split records), num_tokens, num_label_tokens, num_truncated (kept records cut to
            max_seq_len), num_split (records split into pieces), num_dropped (records with nothing to train
            on, counted over all sources), and the same with a `validation_` prefix when there is
            validation data.
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


@dataclass(frozen=True)
class PreviewDocument(Document):
    """A document as training sees it, with its `record` (1-based) and, for a split record, `piece` of `pieces`."""

    record: int = 1
    piece: int = 1
    pieces: int = 1


def preview_documents(config: DataConfig, tokenizer: PreTrainedTokenizerBase, limit: int) -> list[PreviewDocument]:
    """The first `limit` training documents of the first source as training sees them (template, mask, pieces).

    Records with nothing to train on are skipped (as training drops them); a record longer than max_seq_len
    gives the pieces (or the truncation) `data.overlength` makes of it; nothing is cached or packed.
    """
    raw = load_source(config.train[0], config.text_field)
    documents: list[PreviewDocument] = []
    for first, records in iter_records(raw, max(limit, 1)):
        encoded = encode_records(records, config, tokenizer, locate=_locator(raw, first))
        for offset, document in enumerate(encoded):
            pieces, _ = fit_to_length(document, config, raw.where(first + offset))
            for number, piece in enumerate(pieces, start=1):
                documents.append(
                    PreviewDocument(piece.input_ids, piece.labels, first + offset + 1, number, len(pieces))
                )
                if len(documents) == limit:
                    return documents
    return documents


def _build(
    config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, log: Log
) -> tuple[datasets.Dataset, datasets.Dataset | None, dict[str, Any]]:
    """Training rows, validation rows (or None) and their stats, built from the sources."""
    train_docs, num_dropped = _documents(config.train, config, tokenizer, log)
    if config.validation:
        validation_docs, num_validation_dropped = _documents(config.validation, config, tokenizer, log)
    elif config.validation_split > 0:
        train_docs, validation_docs = _split(train_docs, config.validation_split, seed)
        num_validation_dropped = 0
        held_out, kept = (len(pc.unique(docs.data.column("record"))) for docs in (validation_docs, train_docs))
        log(
            f"data: held out {held_out} of {held_out + kept} training records for validation "
            f"(validation_split={config.validation_split}, seed={seed})"
        )
    else:
        validation_docs, num_validation_dropped = None, 0

    train = document_rows(train_docs)
    stats = {**_stats(train_docs), "num_dropped": num_dropped}
    validation = None
    if validation_docs is not None:
        validation = document_rows(validation_docs)
        stats.update({f"validation_{key}": value for key, value in _stats(validation_docs).items()})
        stats["validation_num_dropped"] = num_validation_dropped
    log(
        f"data: {stats['num_records']} records, {stats['num_rows']} documents, {stats['num_tokens']} tokens "
        f"({stats['num_label_tokens']} trained)"
    )
    return train, validation, stats


def _locator(raw: RawSource, first: int) -> Locate:
    """Names record `i` of a chunk that starts at record `first` of `raw`, for error messages."""
    return lambda i: raw.where(first + i)


def _documents(
    sources: list[SourceConfig], config: DataConfig, tokenizer: PreTrainedTokenizerBase, log: Log
) -> tuple[datasets.Dataset, int]:
    """All documents of `sources`, in order, split, cut or refused by `overlength`; and how many records were dropped."""
    chunks, tally = [], _Tally()
    for source in sources:
        raw = load_source(source, config.text_field)
        for first, records in iter_records(raw, _RECORDS_PER_CHUNK):
            encoded = encode_records(records, config, tokenizer, locate=_locator(raw, first))
            chunk: dict[str, list] = {name: [] for name in DOCUMENT_FEATURES}
            for offset, document in enumerate(encoded):
                pieces, too_long = fit_to_length(document, config, raw.where(first + offset))
                tally.count(document, pieces, too_long)
                for piece in pieces:
                    chunk["input_ids"].append(piece.input_ids)
                    chunk["labels"].append(piece.labels)
                    chunk["truncated"].append(too_long and config.overlength == "truncate")
                    chunk["record"].append(tally.num_records - 1)
            chunks.append(pa.table(chunk, schema=DOCUMENT_FEATURES.arrow_schema))
        log(f"data: tokenized {len(raw.records)} records from {source.path}")
    where = ", ".join(source.path for source in sources)
    for line in tally.summary(config):
        log(line)
    num_records, num_dropped = tally.num_records, tally.num_dropped
    documents = arrow_dataset(pa.concat_tables(chunks))
    if len(documents) == 0:
        raise DataError(
            f"no usable records in {where}: all {num_records} were dropped (empty text, or nothing to "
            f"train on, e.g. no assistant turn); check data.format and the field names"
        )
    return documents, num_dropped


@dataclass
class _Tally:
    """Counts over the records of some sources, for the log lines on dropped, split and truncated records."""

    num_records: int = 0
    num_dropped: int = 0
    num_too_long: int = 0
    num_pieces: int = 0
    tokens_in: int = 0
    tokens_kept: int = 0

    def count(self, document: Document | None, pieces: list[Document], too_long: bool) -> None:
        self.num_records += 1
        self.num_dropped += not pieces
        self.num_too_long += too_long
        self.num_pieces += len(pieces) if too_long else 0
        self.tokens_in += len(document.input_ids) if document is not None else 0
        self.tokens_kept += sum(len(piece.input_ids) for piece in pieces)

    def summary(self, config: DataConfig) -> list[str]:
        lines = []
        if self.num_dropped:
            lines.append(
                f"data: dropped {self.num_dropped} of {self.num_records} records with nothing to train on "
                f"(empty text, no assistant turn, or a prompt filling all of max_seq_len)"
            )
        if self.num_too_long and config.overlength == "split":
            lines.append(
                f"data: {self.num_too_long} of {self.num_records} records longer than max_seq_len="
                f"{config.max_seq_len}: split into {self.num_pieces} pieces, all {self.tokens_kept:,} tokens "
                f"kept (data.overlength=split)"
            )
        elif self.num_too_long:
            share = self.tokens_kept / max(self.tokens_in, 1)
            hint = "; data.overlength=split would keep all" if config.format == "text" else ""
            lines.append(
                f"data: truncated {self.num_too_long} of {self.num_records} records to max_seq_len="
                f"{config.max_seq_len} tokens: kept {self.tokens_kept:,} of {self.tokens_in:,} tokens "
                f"({share:.1%}{hint})"
            )
        return lines


def _split(documents: datasets.Dataset, fraction: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation): a seeded random `fraction` of the records held out (with every piece of a split
    record), both kept in record order."""
    table = documents.data.table
    records = pc.unique(table.column("record")).to_numpy()
    num_validation = max(1, round(fraction * len(records)))
    if num_validation >= len(records):
        raise DataError(
            f"data.validation_split={fraction} of {len(records)} records leaves none for training; "
            f"lower it, add data, or give data.validation sources"
        )
    order = np.random.default_rng(seed).permutation(len(records))
    held_out = pc.is_in(table.column("record"), value_set=pa.array(records[order[:num_validation]]))
    return arrow_dataset(table.filter(pc.invert(held_out))), arrow_dataset(table.filter(held_out))


def _stats(documents: datasets.Dataset) -> dict[str, int]:
    table = documents.data.table
    labels = pc.list_flatten(table.column("labels"))
    pieces_per_record = pc.value_counts(table.column("record")).field("counts")
    return {
        "num_records": len(pieces_per_record),
        "num_rows": len(documents),
        "num_tokens": int(sum(document_lengths(documents))),
        "num_label_tokens": int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0),
        "num_truncated": int(pc.sum(table.column("truncated")).as_py() or 0),
        "num_split": int(pc.sum(pc.greater(pieces_per_record, 1)).as_py() or 0),
    }
