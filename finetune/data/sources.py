"""Data sources: local files and saved datasets → raw records, with errors that say where.

A source is one `SourceConfig`: a `.jsonl`, `.json`, `.csv`, `.parquet` or `.txt` file, or a directory
written by `datasets.save_to_disk` (a `Dataset`, or a `DatasetDict` read at `split`, default `train`).
Files are parsed here, in Python, rather than by `datasets.load_dataset`, for two reasons: an error can
name the file, line and record (a JSON syntax error, a non-UTF-8 byte, a record that is not an object),
and records whose fields have mixed types reach the format step intact, where the wrong-typed field is
reported with its record number instead of failing inside Arrow. The price is that file sources are held
in memory while they are tokenized; the tokenized result is Arrow on disk (see `finetune.data.cache`).

File rules:
- `.jsonl`: one JSON object per line; blank lines are skipped.
- `.json`: a JSON array of objects; JSON Lines saved as `.json` (objects one per line) is read as such.
- `.csv`: a header row, then one record per row (every value is a string; empty cells are "").
- `.parquet`: one record per row.
- `.txt`: documents separated by one or more blank lines (`datasets`' `sample_by="paragraph"`); line
  breaks inside a document are kept. Each document becomes a record `{"text": ...}` (the field named
  by `data.text_field`).

Example:
    source = load_source(SourceConfig(path="data/train.jsonl", max_records=100), text_field="text")
    source.records[0]     # {"instruction": "...", "output": "..."}
    source.where(0)       # "data/train.jsonl line 1 (record 1)"
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq

from finetune.errors import DataError
from finetune.recipe import SourceConfig

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
"""File extensions a source may have; anything else must be a `save_to_disk` directory."""

_HASH_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class RawSource:
    """The records of one source, and how to name a record in an error message.

    Attributes:
        path: the source path as written in the recipe.
        records: one dict per record, in file order, already cut to `max_records`.
        line_numbers: 1-based line where each record starts, for line-based files; None otherwise.
    """

    path: str
    records: list[dict[str, Any]] | datasets.Dataset
    line_numbers: Sequence[int] | None = None

    def where(self, index: int) -> str:
        """Human location of record `index` (0-based), e.g. `train.jsonl line 7 (record 5)`."""
        if self.line_numbers is not None:
            return f"{self.path} line {self.line_numbers[index]} (record {index + 1})"
        return f"{self.path} record {index + 1}"


def _check_exists(path: Path, raw_path: str) -> None:
    if not path.exists():
        raise DataError(
            f"data file {raw_path} does not exist; check data.train/data.validation paths "
            f"(relative paths are taken from the current directory, {Path.cwd()})"
        )
    if path.is_file() and path.suffix.lower() not in FILE_SUFFIXES:
        raise DataError(
            f"data file {raw_path} has unsupported extension {path.suffix or '(none)'!r}; "
            f"use one of {', '.join(FILE_SUFFIXES)} or a directory written by datasets.save_to_disk"
        )


def _looks_like_hub_id(raw_path: str) -> bool:
    return raw_path.count("/") == 1 and not raw_path.startswith((".", "/", "~")) and not Path(raw_path).suffix


def local_source_path(source: SourceConfig) -> Path:
    """Where a source's bytes are on this machine: the path itself, or a hub dataset's snapshot in the local cache.

    A hub dataset id (`org/name`) that is not a local path is looked up in the local hub cache without
    touching the network; when it is not there it is downloaded, unless the machine is offline
    (`HF_HUB_OFFLINE=1`), where that is an error saying how to bring it here.
    """
    path = Path(source.path)
    if path.exists() or not _looks_like_hub_id(source.path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source.path, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached (huggingface_hub raises several types for this)
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise DataError(
            f"data source {source.path!r} is neither a local file nor a hub dataset in the local cache, and the hub "
            f"is offline (HF_HUB_OFFLINE); on a machine with network run `hf download --repo-type dataset "
            f"{source.path}` and copy its cache here (HF_HUB_CACHE), or give a local file"
        )
    try:
        return Path(snapshot_download(source.path, repo_type="dataset"))
    except Exception as exc:  # network, auth and not-found errors alike
        raise DataError(
            f"data source {source.path!r}: not a local file, and the hub dataset cannot be fetched "
            f"({type(exc).__name__}); check the id, or download it where there is network"
        ) from None


def source_content_hash(source: SourceConfig) -> str:
    """SHA-256 over the bytes of a source (every file of a saved dataset), for the data fingerprint.

    The path itself is left out, so moving or renaming data does not invalidate the cache; the suffix is
    kept, because the same bytes parse differently as `.csv` and `.txt`.
    """
    path = local_source_path(source)
    _check_exists(path, source.path)
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest.update(("dir" if path.is_dir() else path.suffix.lower()).encode())
    for file in files:
        digest.update(str(file.relative_to(path)).encode() if path.is_dir() else b"")
        try:
            with open(file, "rb") as handle:
                while chunk := handle.read(_HASH_CHUNK_BYTES):
                    digest.update(chunk)
        except OSError as exc:
            raise DataError(f"data file {file} cannot be read ({exc.strerror or exc}); check its permissions") from None
        digest.update(b"\0")
    return digest.hexdigest()


def load_source(source: SourceConfig, text_field: str) -> RawSource:
    """Read one source into records, cut to `source.max_records`.

    Args:
        source: the path, split and record limit from the recipe.
        text_field: the field `.txt` documents are stored under (`data.text_field`).

    Raises:
        DataError: missing or unreadable file, unsupported extension, malformed content, no records.
    """
    path = local_source_path(source)
    _check_exists(path, source.path)
    if path != Path(source.path):  # a hub dataset's snapshot in the local cache
        raw = _load_hub_snapshot(path, source)
    elif path.is_dir():
        raw = _load_saved_dataset(path, source)
    else:
        if source.split is not None:
            raise DataError(
                f"data source {source.path}: 'split' only applies to a directory written by "
                f"datasets.save_to_disk; remove split: {source.split!r}"
            )
        raw = _load_file(path, source.path, text_field)
    if len(raw.records) == 0:
        raise DataError(f"data source {source.path} has no records; add data or remove it from the recipe")
    if source.max_records is not None and source.max_records < len(raw.records):
        keep = source.max_records
        records = raw.records[:keep] if isinstance(raw.records, list) else raw.records.select(range(keep))
        lines = raw.line_numbers[:keep] if raw.line_numbers is not None else None
        raw = RawSource(raw.path, records, lines)
    return raw


def _load_hub_snapshot(path: Path, source: SourceConfig) -> RawSource:
    """A hub dataset's files (a snapshot directory) through `datasets.load_dataset`, split and subset applied."""
    try:
        loaded = datasets.load_dataset(str(path), name=source.subset, split=source.split or "train")
    except Exception as exc:  # builder, split and file errors of datasets
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"data source {source.path} cannot be loaded ({first}); check split/subset, or point at a "
            f"data file or a directory written by datasets.save_to_disk"
        ) from None
    return RawSource(source.path, loaded)


def _load_saved_dataset(path: Path, source: SourceConfig) -> RawSource:
    try:
        loaded = datasets.load_from_disk(str(path), keep_in_memory=False)
    except FileNotFoundError:
        raise DataError(
            f"data source {source.path} is a directory but not one written by datasets.save_to_disk "
            f"(no dataset_info.json or dataset_dict.json); point at a data file or a saved dataset"
        ) from None
    except Exception as exc:  # arrow/json errors of a damaged directory
        raise DataError(
            f"data source {source.path} cannot be read as a saved dataset ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); re-save it with save_to_disk"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        split = source.split or "train"
        if split not in loaded:
            raise DataError(
                f"data source {source.path} has no split {split!r}; set split to one of {', '.join(sorted(loaded))}"
            )
        loaded = loaded[split]
    elif source.split is not None:
        raise DataError(f"data source {source.path} is a single Dataset without splits; remove split: {source.split!r}")
    return RawSource(source.path, loaded)


def _load_file(path: Path, raw_path: str, text_field: str) -> RawSource:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return RawSource(raw_path, _read_parquet(path, raw_path))
    text = _read_utf8(path, raw_path)
    lines: list[int] | None
    if suffix == ".jsonl":
        records, lines = _parse_json_lines(text, raw_path)
    elif suffix == ".json":
        records, lines = _parse_json(text, raw_path)
    elif suffix == ".csv":
        records, lines = _parse_csv(text, raw_path)
    else:
        records, lines = _split_paragraphs(text, text_field)
    return RawSource(raw_path, records, lines)


def _read_utf8(path: Path, raw_path: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"data file {raw_path} cannot be read ({exc.strerror or exc}); check its permissions") from None
    try:
        return data.decode("utf-8-sig")  # tolerate a byte-order mark, as editors on Windows write one
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DataError(
            f"data file {raw_path} is not valid UTF-8: byte 0x{data[exc.start]:02x} at byte offset "
            f"{exc.start} (line {line}); re-encode the file as UTF-8 (e.g. iconv -t UTF-8)"
        ) from None


def _parse_json_lines(text: str, raw_path: str) -> tuple[list[dict[str, Any]], list[int]]:
    records: list[dict[str, Any]] = []
    lines: list[int] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{raw_path} line {line_number}: invalid JSON ({exc.msg} at column {exc.colno}); "
                f"each line of a .jsonl file must be one JSON object"
            ) from None
        _check_object(record, f"{raw_path} line {line_number} (record {len(records) + 1})")
        records.append(record)
        lines.append(line_number)
    return records, lines


def _parse_json(text: str, raw_path: str) -> tuple[list[dict[str, Any]], list[int] | None]:
    """A JSON array of records; JSON Lines saved as `.json` (a common mix-up) is read as JSON Lines."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _parse_json_lines(text, raw_path)
        raise DataError(
            f"{raw_path} line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno}); "
            f"fix the syntax, or use .jsonl with one object per line"
        ) from None
    if isinstance(data, dict) and len(text.strip().splitlines()) == 1:
        return _parse_json_lines(text, raw_path)  # JSON Lines with a single record
    if not isinstance(data, list):
        got = "an object" if isinstance(data, dict) else type(data).__name__
        raise DataError(
            f"{raw_path}: expected a JSON array of records, got {got}; "
            f"write [{{...}}, {{...}}] or use .jsonl with one object per line"
        )
    for index, record in enumerate(data):
        _check_object(record, f"{raw_path} record {index + 1}")
    return data, None


def _check_object(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: a record must be a JSON object with named fields, got "
            f'{type(record).__name__}; write e.g. {{"text": "..."}}'
        )


def _parse_csv(text: str, raw_path: str) -> tuple[list[dict[str, Any]], list[int]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return [], []
        records, lines = [], []
        start_line = reader.line_num + 1
        for row in reader:
            if row:
                if len(row) != len(header):
                    raise DataError(
                        f"{raw_path} line {start_line}: row has {len(row)} values but the header has "
                        f"{len(header)} ({', '.join(header)}); quote values that contain commas"
                    )
                records.append(dict(zip(header, row)))
                lines.append(start_line)
            start_line = reader.line_num + 1
    except csv.Error as exc:
        raise DataError(f"{raw_path} line {reader.line_num}: malformed CSV ({exc}); check the quoting") from None
    return records, lines


def _split_paragraphs(text: str, text_field: str) -> tuple[list[dict[str, Any]], list[int]]:
    records, lines = [], []
    paragraph: list[str] = []
    for line_number, line in enumerate([*text.splitlines(), ""], start=1):
        if line.strip():
            if not paragraph:
                lines.append(line_number)
            paragraph.append(line)
        elif paragraph:
            records.append({text_field: "\n".join(paragraph)})
            paragraph = []
    return records, lines


def _read_parquet(path: Path, raw_path: str) -> datasets.Dataset:
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(
            f"data file {raw_path} cannot be read as Parquet ({str(exc).splitlines()[0]}); "
            f"check that it is a complete .parquet file"
        ) from None
    return datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=uuid.uuid4().hex)  # skip hashing it


def iter_records(raw: RawSource, chunk_records: int) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """Yield (index of the first record, records) in chunks, so formats can tokenize in batches."""
    records = raw.records
    for start in range(0, len(records), chunk_records):
        stop = min(start + chunk_records, len(records))
        if isinstance(records, list):
            yield start, records[start:stop]
        else:  # a datasets.Dataset: one Arrow slice per chunk, turned into row dicts
            columns = records[start:stop]
            yield start, [dict(zip(columns, values)) for values in zip(*columns.values())]
