"""A record longer than `data.max_seq_len`: split into pieces, truncated, or refused (`data.overlength`).

`split` cuts a document's token ids into consecutive pieces of at most max_seq_len tokens, as
pretraining pipelines chunk long text, so nothing is thrown away: the pieces concatenated are the
document (BOS at the start of the first, EOS only at the end of the last). Each piece is trained as a
document of its own, so the first token of every later piece is context, not a target (it would be
predicted across a boundary that packing isolates). A piece of one token would have nothing to train
on, so the last cut moves back one token when it would leave one: every piece has at least two.

`truncate` keeps the first max_seq_len tokens; a record left with no trained label (an instruction whose
prompt fills max_seq_len) is dropped. `error` raises a one-line `DataError` naming the record.

Example:
    split_document(Document([1, 5, 6, 7, 8, 2], [-100, 5, 6, 7, 8, 2]), max_seq_len=4)
    # [Document([1, 5, 6, 7], [-100, 5, 6, 7]), Document([8, 2], [-100, 2])]
"""

from __future__ import annotations

from finetune.data.formats import Document
from finetune.data.labels import IGNORE_INDEX
from finetune.errors import DataError
from finetune.recipe import DataConfig


def piece_bounds(length: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(start, end) of each piece of a `length`-token document: cuts every max_seq_len, none of 1 token."""
    bounds = [(start, min(start + max_seq_len, length)) for start in range(0, length, max_seq_len)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        (first, cut), (_, end) = bounds[-2], bounds[-1]
        bounds[-2:] = [(first, cut - 1), (cut - 1, end)]
    return bounds


def split_document(document: Document, max_seq_len: int) -> list[Document]:
    """Consecutive pieces of `document`, each at most max_seq_len tokens; a piece's first label is -100."""
    pieces = []
    for start, end in piece_bounds(len(document.input_ids), max_seq_len):
        labels = document.labels[start:end]
        pieces.append(Document(document.input_ids[start:end], [IGNORE_INDEX, *labels[1:]]))
    return [piece for piece in pieces if any(label != IGNORE_INDEX for label in piece.labels)]


def fit_to_length(document: Document | None, config: DataConfig, where: str) -> tuple[list[Document], bool]:
    """`data.overlength` applied: (the document's pieces, [] when nothing is left to train; whether it was too long)."""
    if document is None:
        return [], False
    if len(document.input_ids) <= config.max_seq_len:
        return [document], False
    if config.overlength == "error":
        raise DataError(
            f"{where}: {len(document.input_ids)} tokens, longer than data.max_seq_len={config.max_seq_len}; "
            f"raise data.max_seq_len, shorten the record, or set data.overlength to "
            f"{'split or truncate' if config.format == 'text' else 'truncate'}"
        )
    if config.overlength == "split":
        return split_document(document, config.max_seq_len), True
    labels = document.labels[: config.max_seq_len]
    if all(label == IGNORE_INDEX for label in labels):
        return [], True
    return [Document(document.input_ids[: config.max_seq_len], labels)], True
