"""The data pipeline end to end: sources → documents → (validation split) → rows, cached on disk.

Steps, each in its own module: `sources` reads records, `formats` turns each into token ids and labels,
`overlength` splits or truncates records longer than max_seq_len, this module drops records with nothing
to train on and holds out validation data; `cache` keys the result by the data fingerprint so a second
run with the same inputs loads it instead of tokenizing again.

A row of the result is one document (a record, or one piece of a split record). Rows are not packed
here: packing groups the documents of each micro-batch when it is collated (`collate`), so a batch is
the same documents packed or not and packing changes speed only.

Nothing is held whole in memory: sources are read a chunk of records at a time, chunks are encoded by
one worker process per core (`workers`), and each encoded chunk is appended to an Arrow file on disk
(`rowfiles`), which the result memory-maps. Peak memory depends on the chunk size and the number of
workers, not on the size of the corpus; the rows are the same whatever the number of workers.

Validation data is `data.validation` when given, else a seeded `data.validation_split` fraction of the
training records (all pieces of a split record on the same side), else none.

Example:
    bundle = build_datasets(recipe.data, tokenizer, seed=recipe.train.seed, log=print)
    bundle.train[0].keys()   # input_ids, labels
    bundle.stats["num_label_tokens"]
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from finetune.data import cache
from finetune.data.formats import Document, encode_records
from finetune.data.overlength import fit_to_length
from finetune.data.packing import ROW_FEATURES
from finetune.data.preference import ROW_FEATURES_BY_FORMAT, encode_preference_records, no_room_error
from finetune.data.prompts import PROMPT_FEATURES, encode_prompt_records
from finetune.data.rowfiles import partition_rows, stream_writer
from finetune.data.sources import RecordChunk, iter_records, load_source
from finetune.data.workers import default_num_proc, ordered_map
from finetune.errors import DataError
from finetune.recipe import OWN_ROW_FORMATS, DataConfig, SourceConfig

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
pieces of a split record share it). The preference formats' rows have their own columns (`document_features`)."""


OWN_ROW_FEATURES = {**ROW_FEATURES_BY_FORMAT, "prompt": PROMPT_FEATURES}
"""The rows of the formats that are not documents (`OWN_ROW_FORMATS`)."""
_ENCODERS = {"preference": encode_preference_records, "unpaired_preference": encode_preference_records,
             "prompt": encode_prompt_records}  # fmt: skip


def row_features(data_format: str) -> datasets.Features:
    """The columns of the rows training reads: `input_ids` and `labels`, or a preference or prompt format's own."""
    return OWN_ROW_FEATURES.get(data_format, ROW_FEATURES)


def document_features(data_format: str) -> datasets.Features:
    """The columns a record's documents are written with: the format's row columns, `truncated` and `record`."""
    if data_format not in OWN_ROW_FORMATS:
        return DOCUMENT_FEATURES
    bookkeeping = {name: DOCUMENT_FEATURES[name] for name in ("truncated", "record")}
    return datasets.Features({**OWN_ROW_FEATURES[data_format], **bookkeeping})


_RECORDS_PER_CHUNK = 1000
_CHARS_PER_CHUNK = 1 << 20
"""A chunk, the unit of work of a worker, ends at 1000 records or about 1 MiB of text: a second or two of
tokenizing, and some tens of MB of Python objects in a worker at most."""


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
    """Read, tokenize and split the data of a recipe, or load the result of an earlier run.

    Args:
        config: the recipe's `data` section.
        tokenizer: the base model's tokenizer (its identity is part of the fingerprint).
        seed: seeds the validation split (`train.seed`); unused without `validation_split`.
        log: receives one-line progress messages.
        cache_dir: where tokenized rows are cached; default `$HF_DATASETS_CACHE/finetune`.
        use_cache: False builds in a temporary directory, returns the rows in memory and leaves nothing
            on disk (for one-off inspection of small data).

    Raises:
        DataError: a source is missing, unreadable or empty, or a record does not fit the format.
    """
    inputs = cache.fingerprint_inputs(config, tokenizer, seed)
    fingerprint = cache.fingerprint_of(inputs)
    cache_root = Path(cache_dir) if cache_dir is not None else cache.default_cache_root()
    if use_cache and (entry := cache.load_cached(cache_root, fingerprint)) is not None:
        log(f"data: {entry.stats['num_rows']} training rows loaded from cache {entry.path} (no tokenizing)")
        stats, notes = _without_notes(entry.stats)
        for line in notes:  # what tokenizing said of dropped or truncated records holds for these rows too
            log(line)
        return DataBundle(entry.train, entry.validation, fingerprint, stats, True, entry.path)

    def build(directory: Path) -> tuple[dict[str, Any], bool]:
        return _build(config, tokenizer, seed, log, directory)

    with _quiet_datasets():
        if not use_cache:
            with tempfile.TemporaryDirectory(prefix="finetune-data-") as scratch:
                stats, has_validation = build(Path(scratch))
                train = cache.load_rows(Path(scratch), "train", in_memory=True)
                validation = cache.load_rows(Path(scratch), "validation", in_memory=True) if has_validation else None
            return DataBundle(train, validation, fingerprint, _without_notes(stats)[0], False, None)
        path = cache.store(cache_root, fingerprint, build, inputs)
    entry = cache.load_cached(cache_root, fingerprint)
    assert entry is not None, f"cache entry {path} unreadable right after writing it"
    log(f"data: rows cached in {path}")
    return DataBundle(entry.train, entry.validation, fingerprint, _without_notes(entry.stats)[0], False, entry.path)


NOTES_KEY = "notes"
"""The stats key (in the cache's meta.json only) of the lines tokenizing logged on dropped, split and truncated
records: a run that loads the rows from the cache logs them again, and the bundle's stats leave them out."""


def _without_notes(stats: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    return {key: value for key, value in stats.items() if key != NOTES_KEY}, list(stats.get(NOTES_KEY, []))


@dataclass(frozen=True)
class PreviewDocument(Document):
    """A document as training sees it, with its `record` (1-based) and, for a split record, `piece` of `pieces`;
    `dropped`: the record has nothing to train on, and training drops it (no tokens here)."""

    record: int = 1
    piece: int = 1
    pieces: int = 1
    dropped: bool = False


def preview_documents(config: DataConfig, tokenizer: PreTrainedTokenizerBase, limit: int) -> list[PreviewDocument]:
    """The first `limit` training documents of the first source as training sees them (template, mask, pieces).

    A record with nothing to train on is one `dropped` entry (training drops it); a record longer than
    max_seq_len gives the pieces (or the truncation) `data.overlength` makes of it; nothing is cached or packed.
    """
    raw = load_source(config.train[0], config.text_field)
    documents: list[PreviewDocument] = []
    for chunk in iter_records(raw, max(limit, 1)):
        encoded = encode_records(chunk.records, config, tokenizer, locate=chunk.where)
        for offset, whole in enumerate(encoded):
            for document in whole.with_more() if whole is not None else [None]:
                pieces, _ = fit_to_length(document, config, chunk.where(offset))
                record = chunk.first + offset + 1
                shown = [
                    PreviewDocument(piece.input_ids, piece.labels, record=record, piece=number, pieces=len(pieces))
                    for number, piece in enumerate(pieces, start=1)
                ] or [PreviewDocument([], [], record=record, dropped=True)]
                documents.extend(shown[: limit - len(documents)])
                if len(documents) == limit:
                    return documents
    return documents


def _build(
    config: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int, log: Log, directory: Path
) -> tuple[dict[str, Any], bool]:
    """Write the training (and validation) rows into `directory`; return their stats and whether there is
    validation data."""
    num_proc = config.num_proc or default_num_proc()
    schema = row_features(config.format).arrow_schema
    split_off = not config.validation and config.validation_split > 0
    train_documents = directory / "documents-train.arrow"
    notes: list[str] = []
    num_dropped, kept = _write_documents(
        config.train, config, tokenizer, num_proc, train_documents, log, split_off, notes
    )
    validation_stats: dict[str, int] | None = None
    num_validation_dropped, held_out = 0, None
    if config.validation:
        if config.validation_split:  # a catalog recipe's split, with the user's own held-out data: say which counts
            log(f"data: data.validation is given, so data.validation_split={config.validation_split} is not used")
        validation_documents = directory / "documents-validation.arrow"
        num_validation_dropped, _ = _write_documents(
            config.validation, config, tokenizer, num_proc, validation_documents, log, False, notes
        )
        validation_stats, _ = partition_rows(validation_documents, schema, cache.rows_file(directory, "validation"))
        validation_documents.unlink()
    elif split_off:
        held_out = _held_out_records(kept, config.validation_split, seed)
        held = int(np.count_nonzero(held_out))
        log(
            f"data: held out {held} of {len(kept)} training records for validation "
            f"(validation_split={config.validation_split}, seed={seed})"
        )
    train_stats, split_stats = partition_rows(
        train_documents,
        schema,
        cache.rows_file(directory, "train"),
        cache.rows_file(directory, "validation") if held_out is not None else None,
        held_out,
    )
    train_documents.unlink()
    validation_stats = validation_stats or split_stats
    stats: dict[str, Any] = {**train_stats, "num_dropped": num_dropped, NOTES_KEY: notes}
    if validation_stats is not None:
        stats.update({f"validation_{key}": value for key, value in validation_stats.items()})
        stats["validation_num_dropped"] = num_validation_dropped
    log(
        f"data: {stats['num_records']} records, {stats['num_rows']} documents, {stats['num_tokens']} tokens "
        f"({stats['num_label_tokens']} trained)"
    )
    return stats, validation_stats is not None


@dataclass(frozen=True)
class _Job:
    """A chunk of records to encode; `first_record` numbers its first record across all the sources."""

    chunk: RecordChunk
    first_record: int
    source_index: int


def _jobs(sources: list[SourceConfig], config: DataConfig) -> Iterator[_Job]:
    """Chunks of every source in order; a source is opened (and checked) only when its turn comes."""
    first_record = 0
    for index, source in enumerate(sources):
        raw = load_source(source, config.text_field)
        for chunk in iter_records(raw, _RECORDS_PER_CHUNK, _CHARS_PER_CHUNK):
            yield _Job(chunk, first_record, index)
            first_record += len(chunk.records)


def _encode_chunk(state: tuple[DataConfig, PreTrainedTokenizerBase], job: _Job) -> _Encoded:
    """Encode a chunk and apply `overlength`: one row per document (a record, or a piece of one)."""
    config, tokenizer = state
    if config.format in OWN_ROW_FORMATS:
        return _encode_preference_chunk(config, tokenizer, job)
    chunk = job.chunk
    encoded = encode_records(chunk.records, config, tokenizer, locate=chunk.where)
    columns: dict[str, list] = {name: [] for name in DOCUMENT_FEATURES}
    tally = _Tally()
    for offset, whole in enumerate(encoded):
        pieces: list[Document] = []
        too_long = False
        lost = 0
        for document in whole.with_more() if whole is not None else [None]:  # every_turn: one per turn
            fitted, cut = fit_to_length(document, config, chunk.where(offset))
            pieces, too_long, lost = pieces + fitted, too_long or cut, lost + (not fitted)
        tally.num_parts_dropped += lost if pieces else 0  # of a kept record (a dropped one is counted whole)
        tally.num_reasoning_dropped += int(whole is not None and whole.reasoning_dropped)
        tally.count(whole, pieces, too_long, chunk.where(offset))
        for piece in pieces:
            columns["input_ids"].append(piece.input_ids)
            columns["labels"].append(piece.labels)
            columns["truncated"].append(too_long and config.overlength == "truncate")
            columns["record"].append(job.first_record + offset)
    batch = pa.RecordBatch.from_pydict(columns, schema=DOCUMENT_FEATURES.arrow_schema)
    return _Encoded(batch, tally, job.source_index)


def _encode_preference_chunk(config: DataConfig, tokenizer: PreTrainedTokenizerBase, job: _Job) -> _Encoded:
    """One row per preference or prompt record (a pair, an unpaired example, a prompt), counted like documents."""
    chunk = job.chunk
    features = document_features(config.format)
    columns: dict[str, list] = {name: [] for name in features}
    tally = _Tally()
    for offset, encoded in enumerate(_ENCODERS[config.format](chunk.records, config, tokenizer, chunk.where)):
        kept = encoded.row is not None
        tally.count_record(encoded.tokens_in, encoded.tokens_kept, encoded.too_long, kept, chunk.where(offset))
        if encoded.no_room:
            tally.num_no_room += 1
            tally.first_no_room = tally.first_no_room or chunk.where(offset)
        if encoded.row is None:
            continue
        for name, value in encoded.row.items():
            columns[name].append(value)
        columns["truncated"].append(encoded.too_long)
        columns["record"].append(job.first_record + offset)
    return _Encoded(pa.RecordBatch.from_pydict(columns, schema=features.arrow_schema), tally, job.source_index)


def _write_documents(
    sources: list[SourceConfig],
    config: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    num_proc: int,
    path: Path,
    log: Log,
    keep_record_ids: bool,
    notes: list[str],
) -> tuple[int, np.ndarray]:
    """Encode every record of `sources` into an Arrow stream of documents at `path`, in order; the lines it
    logs on dropped, split and truncated records are also appended to `notes`.

    Returns:
        How many records were dropped (nothing to train on), and with `keep_record_ids` the ids of the
        records that were kept, ascending (8 bytes a record, for the validation split); else none.
    """
    tally, kept, records_of_source = _Tally(), [], [0] * len(sources)
    done = 0  # sources whose every record has been written

    def log_done(until: int) -> int:
        for index in range(done, until):
            log(f"data: tokenized {records_of_source[index]} records from {sources[index].path}")
        return until

    with stream_writer(path, document_features(config.format).arrow_schema) as writer:
        for encoded in ordered_map(_encode_chunk, _jobs(sources, config), (config, tokenizer), num_proc):
            done = log_done(encoded.source_index)
            writer.write_batch(encoded.documents)
            tally.merge(encoded.tally)
            records_of_source[encoded.source_index] += encoded.tally.num_records
            if keep_record_ids:
                kept.append(np.unique(encoded.documents.column("record").to_numpy()))
    log_done(len(sources))
    for line in tally.summary(config):
        log(line)
        notes.append(line)
    if tally.num_no_room:
        raise no_room_error(tally.num_no_room, tally.num_records, tally.first_no_room, config)
    if tally.num_records == tally.num_dropped:
        where = ", ".join(source.path for source in sources)
        raise DataError(
            f"no usable records in {where}: all {tally.num_records} were dropped (empty text or response, no "
            f"assistant turn, or a prompt filling all of data.max_seq_len={config.max_seq_len}); check data.format, "
            "the field names and data.max_seq_len"
        )
    return tally.num_dropped, np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)


@dataclass
class _Tally:
    """Counts over the records of some sources, for the log lines on dropped, split and truncated records."""

    num_records: int = 0
    num_dropped: int = 0
    num_too_long: int = 0
    num_pieces: int = 0
    tokens_in: int = 0
    tokens_kept: int = 0
    num_no_room: int = 0
    """Preference records whose prompt leaves no room for a completion within max_seq_len."""
    first_no_room: str = ""
    """Where the first of those is, for the error that refuses them."""
    first_dropped: str = ""
    """Where the first record dropped is, for the log line that counts them."""
    num_parts_dropped: int = 0
    """Documents of kept records (`data.reasoning: every_turn` makes one per turn) left with nothing to train on."""
    num_reasoning_dropped: int = 0
    """Records whose reasoning the chat template renders in no turn (see `Document.reasoning_dropped`)."""

    def count(self, document: Document | None, pieces: list[Document], too_long: bool, where: str) -> None:
        self.num_pieces += len(pieces) if too_long else 0
        tokens_in = sum(len(d.input_ids) for d in document.with_more()) if document is not None else 0
        self.count_record(tokens_in, sum(len(piece.input_ids) for piece in pieces), too_long, bool(pieces), where)

    def count_record(self, tokens_in: int, tokens_kept: int, too_long: bool, kept: bool, where: str) -> None:
        self.num_records += 1
        self.num_dropped += not kept
        self.first_dropped = self.first_dropped or ("" if kept else where)
        self.num_too_long += too_long
        self.tokens_in += tokens_in
        self.tokens_kept += tokens_kept

    def merge(self, other: _Tally) -> None:
        """Add the counts of `other` (records that follow these); the first location found stays."""
        for name, value in zip(self.__dataclass_fields__, astuple(other)):
            mine = getattr(self, name)
            setattr(self, name, mine + value if isinstance(mine, int) else mine or value)

    def summary(self, config: DataConfig) -> list[str]:
        lines = []
        if self.num_dropped:
            lines.append(
                f"data: dropped {self.num_dropped} of {self.num_records} records with nothing to train on "
                f"(empty text or response, no assistant turn, or a prompt filling all of max_seq_len; the first: "
                f"{self.first_dropped})"
            )
        if self.num_parts_dropped:
            lines.append(
                f"data: {self.num_parts_dropped} documents of kept records had nothing left to train on within max_seq_len="
                f"{config.max_seq_len} and were dropped (data.reasoning=every_turn makes one per assistant turn)"
            )
        if self.num_reasoning_dropped:
            lines.append(
                f"data: the chat template renders no assistant reasoning (the DeepSeek-R1 distills' cuts it from every "
                f"turn), so the reasoning of {self.num_reasoning_dropped} of {self.num_records} records is not trained; "
                "give data.chat_template a template that keeps it (trl ships deepseek_r1_distill_training.jinja), or "
                "set data.reasoning=none"
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


@dataclass(frozen=True)
class _Encoded:
    """The documents of one chunk (DOCUMENT_FEATURES columns) and the counts over its records."""

    documents: pa.RecordBatch
    tally: _Tally
    source_index: int


def _held_out_records(kept: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """One flag per record id, True for a seeded random `fraction` of the `kept` records (ascending ids)."""
    num_validation = max(1, round(fraction * len(kept)))
    if num_validation >= len(kept):
        raise DataError(
            f"data.validation_split={fraction} of {len(kept)} records leaves none for training; "
            f"lower it, add data, or give data.validation sources"
        )
    order = np.random.default_rng(seed).permutation(len(kept))
    held_out = np.zeros(int(kept[-1]) + 1, dtype=bool)
    held_out[kept[order[:num_validation]]] = True
    return held_out
