"""Data sources: local files and saved datasets → raw records, with errors that say where.

A source is one `SourceConfig`: a `.jsonl`, `.json`, `.csv`, `.parquet` or `.txt` file, or a directory
written by `datasets.save_to_disk` (a `Dataset`, or a `DatasetDict` read at `split`, default `train`).
Files are parsed here, in Python, rather than by `datasets.load_dataset`, for two reasons: an error can
name the file, line and record (a JSON syntax error, a non-UTF-8 byte, a record that is not an object),
and records whose fields have mixed types reach the format step intact, where the wrong-typed field is
reported with its record number instead of failing inside Arrow. Files are read a block at a time and
handed on a chunk of records at a time (`iter_records`), so a corpus need not fit in memory; only a
`.json` array is parsed whole.

File rules:
- `.jsonl`: one JSON object per line; blank lines are skipped.
- `.json`: a JSON array of objects; JSON Lines saved as `.json` (objects one per line) is read as such.
- `.csv`: a header row, then one record per row (every value is a string; empty cells are ""); a quoted
  value still open at the end of the file is an error naming its row, not one value holding every later row.
- `.parquet`: one record per row.
- `.txt`: documents separated by one or more blank lines (`datasets`' `sample_by="paragraph"`); line
  breaks inside a document are kept. Each document becomes a record `{"text": ...}` (the field named
  by `data.text_field`).

Example:
    raw = load_source(SourceConfig(path="data/train.jsonl", max_records=100), text_field="text")
    chunk = next(iter_records(raw, chunk_records=1000))
    chunk.records[0]     # {"instruction": "...", "output": "..."}
    chunk.where(0)       # "data/train.jsonl line 1 (record 1)"
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq

from finetune.errors import DataError
from finetune.recipe import SourceConfig
from finetune.strict_json import is_text

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".txt")
"""File extensions a source may have; anything else must be a `save_to_disk` directory."""

_HASH_CHUNK_BYTES = 1 << 20
_SAVED_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json")
"""What `datasets.save_to_disk` writes at the top of a `Dataset` and of a `DatasetDict` directory."""


@dataclass(frozen=True)
class RawSource:
    """A source opened for reading: checked (exists, readable kind, split), its records not yet read.

    File sources are read by `iter_records`, a bounded chunk at a time, so a corpus larger than memory can
    be tokenized; a saved or hub dataset is already Arrow on disk, memory-mapped, and is sliced.

    Attributes:
        path: the source path as written in the recipe.
        file: the local file to parse, for file sources; None for datasets.
        dataset: the memory-mapped records of a saved or hub dataset; None for files.
        text_field: the field `.txt` documents are stored under (`data.text_field`).
        max_records: read at most this many records (the source's `max_records`).
    """

    path: str
    file: Path | None = None
    dataset: datasets.Dataset | None = None
    text_field: str = "text"
    max_records: int | None = None


@dataclass(frozen=True)
class RecordChunk:
    """Consecutive records of one source, and how to name each in an error message.

    Attributes:
        path: the source path as written in the recipe.
        first: 0-based index of `records[0]` within its source.
        records: one dict per record, in file order.
        line_numbers: 1-based line where each record starts, for line-based files; None otherwise.
    """

    path: str
    first: int
    records: list[dict[str, Any]]
    line_numbers: list[int] | None = None

    def where(self, index: int) -> str:
        """Human location of `records[index]`, e.g. `train.jsonl line 7 (record 5)`."""
        number = self.first + index + 1
        if self.line_numbers is not None:
            return f"{self.path} line {self.line_numbers[index]} (record {number})"
        return f"{self.path} record {number}"


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


def check_local_source(source: SourceConfig) -> None:
    """A source named by a local path exists and has a readable kind (DataError otherwise); a hub id is left to
    loading, which may find it in the local cache. `finetune validate` checks the recipe's sources with it."""
    path = Path(source.path)
    if path.exists() or not _looks_like_hub_id(source.path):
        _check_exists(path, source.path)
    if path.is_dir() and not any((path / marker).is_file() for marker in _SAVED_DATASET_MARKERS):
        raise DataError(
            f"data source {source.path or repr(source.path)} is a directory but not one written by "
            f"datasets.save_to_disk (no {' or '.join(_SAVED_DATASET_MARKERS)}); point at a data file or a saved dataset"
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
    """Open one source for `iter_records`: everything is checked that can be without reading every record.

    Args:
        source: the path, split and record limit from the recipe.
        text_field: the field `.txt` documents are stored under (`data.text_field`).

    Raises:
        DataError: missing file, unsupported extension, a split that does not apply or does not exist, an
            empty dataset. Malformed content and empty files are found by `iter_records`.
    """
    path = local_source_path(source)
    _check_exists(path, source.path)
    if path != Path(source.path):  # a hub dataset's snapshot in the local cache
        raw = RawSource(source.path, dataset=_load_hub_snapshot(path, source), max_records=source.max_records)
    elif path.is_dir():
        raw = RawSource(source.path, dataset=_load_saved_dataset(path, source), max_records=source.max_records)
    else:
        if source.split is not None:
            raise DataError(
                f"data source {source.path}: 'split' only applies to a directory written by "
                f"datasets.save_to_disk; remove split: {source.split!r}"
            )
        if path.suffix.lower() == ".parquet":
            _open_parquet(path, source.path)  # a damaged file fails here, before anything is tokenized
        return RawSource(source.path, file=path, text_field=text_field, max_records=source.max_records)
    if raw.dataset is not None and len(raw.dataset) == 0:
        raise _no_records(source.path)
    return raw


def _load_hub_snapshot(path: Path, source: SourceConfig) -> datasets.Dataset:
    """A hub dataset's files (a snapshot directory) through `datasets.load_dataset`, split and subset applied."""
    try:
        loaded = datasets.load_dataset(str(path), name=source.subset, split=source.split or "train")
    except Exception as exc:  # builder, split and file errors of datasets
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"data source {source.path} cannot be loaded ({first}); check split/subset, or point at a "
            f"data file or a directory written by datasets.save_to_disk"
        ) from None
    return loaded


def _load_saved_dataset(path: Path, source: SourceConfig) -> datasets.Dataset:
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
    return loaded


def _no_records(raw_path: str) -> DataError:
    return DataError(f"data source {raw_path} has no records; add records to it, or leave it out")


def iter_records(raw: RawSource, chunk_records: int, chunk_chars: int | None = None) -> Iterator[RecordChunk]:
    """The records of `raw` in order, in chunks of at most `chunk_records` records (cut to `max_records`).

    A file is parsed as the chunks are taken, so only a chunk (and a block of the file) is in memory at a
    time; `.json` arrays are the exception (one JSON document, parsed whole).

    Args:
        raw: an opened source (`load_source`).
        chunk_records: most records per chunk.
        chunk_chars: also end a chunk once its records hold this many characters (every kind of source); bounds
            memory when records are large. A single larger record still makes a chunk of its own.

    Raises:
        DataError: malformed content (naming file and line), a file without records.
    """
    if raw.dataset is not None:
        parsed = _dataset_records(raw.dataset, chunk_records)
    else:
        assert raw.file is not None
        parsed = _file_records(raw.file, raw.path, raw.text_field)
    records: list[dict[str, Any]] = []
    lines: list[int | None] = []
    first, chars = 0, 0
    for record, line, size in islice(parsed, raw.max_records):
        records.append(record)
        lines.append(line)
        chars += size
        if len(records) == chunk_records or (chunk_chars is not None and chars >= chunk_chars):
            yield _chunk(raw.path, first, records, lines)
            first, records, lines, chars = first + len(records), [], [], 0
    if records:
        yield _chunk(raw.path, first, records, lines)
    elif first == 0:
        raise _no_records(raw.path)


def _dataset_records(dataset: datasets.Dataset, slice_rows: int) -> Parsed:
    """The rows of a saved or hub dataset, read an Arrow slice of `slice_rows` at a time."""
    for start in range(0, len(dataset), slice_rows):
        columns = dataset[start : start + slice_rows]
        for values in zip(*columns.values()):
            record = dict(zip(columns, values))
            yield record, None, _chars(record)


def _chars(value: Any) -> int:
    """Characters in the strings of a record read whole (a Parquet row, a `.json` array's item, a dataset row),
    nested ones too: its share of a chunk's text. Without it such records counted 0, and a chunk of long
    documents took `chunk_records` of them whatever their size (a Parquet corpus of 250 KB documents: 2.7x the
    peak memory of the same records as JSON Lines). A list of numbers is skipped without a look at each."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(item) for item in value.values())
    if isinstance(value, list) and value and isinstance(value[0], (str, dict, list)):
        return sum(_chars(item) for item in value)
    return 0


def _chunk(path: str, first: int, records: list[dict[str, Any]], lines: list[int | None]) -> RecordChunk:
    numbers = None if lines[0] is None else [line for line in lines if line is not None]
    return RecordChunk(path, first, records, numbers)


Parsed = Iterator[tuple[dict[str, Any], int | None, int]]
"""(record, 1-based line where it starts or None, its size in characters) for each record of a file."""


def _file_records(path: Path, raw_path: str, text_field: str) -> Parsed:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _parquet_records(path, raw_path)
    if suffix == ".json":
        return _parse_json("".join(_utf8_blocks(path, raw_path)), raw_path)
    if suffix == ".csv":
        return _parse_csv(_utf8_blocks(path, raw_path), raw_path)
    lines = (line for block in _utf8_blocks(path, raw_path) for line in _lines(block))
    if suffix == ".jsonl":
        return _parse_json_lines(lines, raw_path)
    return _split_paragraphs(lines, text_field)


_READ_BLOCK_BYTES = 1 << 20

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def _lines(text: str) -> list[str]:
    """The lines of `text`, split at CR LF, LF and CR only. `str.splitlines` also splits at U+2028, U+2029,
    U+0085 and form feeds, which JSON strings may hold unescaped (`json.dumps(..., ensure_ascii=False)` writes
    them so) and which are part of a document's text, not line breaks."""
    lines = _LINE_BREAK.split(text)
    if lines and lines[-1] == "":  # the text ends with a line break: no line after it
        lines.pop()
    return lines


def _utf8_blocks(path: Path, raw_path: str) -> Iterator[str]:
    """The file's text in blocks of about 1 MiB, each cut just after a newline byte.

    A block never ends inside a line, a UTF-8 sequence or a CR LF pair, so splitting each block into
    lines gives the lines of the whole text, and a decoding error can name its byte offset and line.
    """
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise DataError(f"data file {raw_path} cannot be read ({exc.strerror or exc}); check its permissions") from None
    with handle:
        offset, line, buffer = 0, 1, bytearray()
        while True:
            data = handle.read(_READ_BLOCK_BYTES)
            at_end = not data
            newline = data.rfind(b"\n")
            if newline < 0 and not at_end:  # a line longer than a block: read on
                buffer += data
                continue
            cut = len(buffer) + (len(data) if at_end else newline + 1)
            buffer += data
            if cut == 0:  # at the end, nothing left
                return
            block = bytes(buffer[:cut])
            del buffer[:cut]
            skip = 3 if offset == 0 and block.startswith(b"\xef\xbb\xbf") else 0  # an editor's byte-order mark
            try:
                text = block[skip:].decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = skip + exc.start
                bad_line = line + block[:bad].count(b"\n")
                raise DataError(
                    f"data file {raw_path} is not valid UTF-8: byte 0x{block[bad]:02x} at byte offset "
                    f"{offset + bad} (line {bad_line}); re-encode the file as UTF-8 (e.g. iconv -t UTF-8)"
                ) from None
            if text:
                yield text
            offset, line = offset + cut, line + block.count(b"\n")
            if at_end:
                return


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
"""A JSON escape of a UTF-16 surrogate: half of a pair (an emoji written `\\ud83d\\ude00`), or alone."""


def _check_text(record: dict[str, Any], where: str) -> None:
    """Refuse a record holding a lone surrogate (`strict_json.is_text`): the tokenizer rejects it with a TypeError
    deep in a worker. Callers check only records whose source has a surrogate escape at all (`_SURROGATE_ESCAPE`,
    searched once per line or file), so plain records cost nothing."""
    if not is_text(record):
        raise DataError(
            f"{where}: a string holds a lone surrogate escape (\\ud800-\\udfff without its pair), which is not "
            f"text; remove it or write the character whole, e.g. with json.dumps of the original text"
        )


def _parse_json_lines(lines: Iterable[str], raw_path: str) -> Parsed:
    number = 0
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{raw_path} line {line_number}: invalid JSON ({exc.msg} at column {exc.colno}); "
                f"each line of a .jsonl file must be one JSON object"
            ) from None
        number += 1
        where = f"{raw_path} line {line_number} (record {number})"
        _check_object(record, where)
        if _SURROGATE_ESCAPE.search(line) is not None:
            _check_text(record, where)
        yield record, line_number, len(line)


def _parse_json(text: str, raw_path: str) -> Parsed:
    """A JSON array of records; JSON Lines saved as `.json` (a common mix-up) is read as JSON Lines."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _parse_json_lines(_lines(text), raw_path)
        raise DataError(
            f"{raw_path} line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno}); "
            f"fix the syntax, or use .jsonl with one object per line"
        ) from None
    if isinstance(data, dict) and len(_lines(text.strip())) == 1:
        return _parse_json_lines(_lines(text), raw_path)  # JSON Lines with a single record
    if not isinstance(data, list):
        got = "an object" if isinstance(data, dict) else type(data).__name__
        raise DataError(
            f"{raw_path}: expected a JSON array of records, got {got}; "
            f"write [{{...}}, {{...}}] or use .jsonl with one object per line"
        )
    escaped = _SURROGATE_ESCAPE.search(text) is not None  # once: searched per record, it scanned the whole file
    for index, record in enumerate(data):
        _check_object(record, f"{raw_path} record {index + 1}")
        if escaped:
            _check_text(record, f"{raw_path} record {index + 1}")
    return ((record, None, _chars(record)) for record in data)


def _check_object(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise DataError(
            f"{where}: a record must be a JSON object with named fields, got "
            f'{type(record).__name__}; write e.g. {{"text": "..."}}'
        )


_CSV_END = "\ufdd0end of file\ufdd0"
"""A last line fed to the CSV reader after the file's own: read as a row of its own, unless a quoted value is
still open, which then swallows it. (Python's reader, unless strict, ends an open quote silently at the end of
the file, so one missing closing quote made every later row part of one value; strict mode would also refuse
the common `"x"  ` with spaces after the quote.) U+FDD0 is a noncharacter, in no real value."""


def _parse_csv(blocks: Iterable[str], raw_path: str) -> Parsed:
    # csv wants lines split at \r, \n and \r\n only, with their endings (quoted values span lines)
    lines = chain((line for block in blocks for line in io.StringIO(block, newline="")), [_CSV_END])
    reader = csv.reader(lines)
    try:
        header = next(reader, None)
        if header is None or header == [_CSV_END]:
            return
        _check_quotes_closed(header, raw_path, 1)
        start_line = reader.line_num + 1
        for row in reader:
            if row == [_CSV_END]:
                return
            _check_quotes_closed(row, raw_path, start_line)
            if row:
                if len(row) != len(header):
                    raise DataError(
                        f"{raw_path} line {start_line}: row has {len(row)} values but the header has "
                        f"{len(header)} ({', '.join(header)}); quote values that contain commas"
                    )
                yield dict(zip(header, row)), start_line, sum(map(len, row))
            start_line = reader.line_num + 1
    except csv.Error as exc:
        raise DataError(f"{raw_path} line {reader.line_num}: malformed CSV ({exc}); check the quoting") from None


def _check_quotes_closed(row: list[str], raw_path: str, line: int) -> None:
    """A row that swallowed `_CSV_END` had a quoted value still open at the end of the file."""
    if row and _CSV_END in row[-1]:
        raise DataError(
            f"{raw_path} line {line}: a quoted value opened in this row is never closed, so the rest of the file "
            f'would be read as one value; add the closing quote (a quote inside a quoted value is written "")'
        )


def _split_paragraphs(lines: Iterable[str], text_field: str) -> Parsed:
    """Documents separated by blank lines; each record starts at its first non-blank line."""
    paragraph: list[str] = []
    start = 0
    for line_number, line in enumerate(chain(lines, [""]), start=1):
        if line.strip():
            if not paragraph:
                start = line_number
            paragraph.append(line)
        elif paragraph:
            text = "\n".join(paragraph)
            yield {text_field: text}, start, len(text)
            paragraph = []


_PARQUET_BATCH_ROWS = 1000


def _open_parquet(path: Path, raw_path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(
            f"data file {raw_path} cannot be read as Parquet ({str(exc).splitlines()[0]}); "
            f"check that it is a complete .parquet file"
        ) from None


def _parquet_records(path: Path, raw_path: str) -> Parsed:
    """Rows of a Parquet file, read a batch of rows at a time."""
    batches = _open_parquet(path, raw_path).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, ValueError) as exc:
            raise DataError(
                f"data file {raw_path} cannot be read as Parquet ({str(exc).splitlines()[0]}); "
                f"check that it is a complete .parquet file"
            ) from None
        if batch is None:
            return
        for record in batch.to_pylist():
            yield record, None, _chars(record)
