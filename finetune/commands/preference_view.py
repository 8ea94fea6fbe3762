"""How `finetune data preview` shows preference records: chosen and rejected side by side, trained tokens marked.

A pair's two sequences share their prompt; it is printed once, then the two completions in two columns
(`chosen` | `rejected`), each token run that carries loss marked (green on a terminal, `[[...]]`
otherwise). An unpaired example shows its prompt, then its completion with its label.

Example:
    print(side_by_side(tokenizer, chosen_ids, chosen_labels, rejected_ids, rejected_labels, width=100, colour=False))
"""

from __future__ import annotations

import textwrap
from typing import Any

from finetune.data.chat_turns import common_prefix_length
from finetune.data.labels import IGNORE_INDEX

_GREEN, _RESET = "\033[32m", "\033[0m"


def _segments(tokenizer: Any, input_ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """The text of each maximal run of trained / untrained tokens, in order."""
    segments: list[tuple[str, bool]] = []
    run: list[int] = []
    trained_run = False
    for token, label in [*zip(input_ids, labels), (None, None)]:
        trained = label is not None and label != IGNORE_INDEX
        if token is None or trained != trained_run:
            if run:
                segments.append((tokenizer.decode(run), trained_run))
            run, trained_run = [], trained
        if token is not None:
            run.append(token)
    return segments


def _lines(segments: list[tuple[str, bool]], width: int, colour: bool) -> list[tuple[str, int]]:
    """The segments laid out in lines of at most `width` visible characters: (line with marks, visible length)."""
    characters: list[tuple[str, bool]] = []
    for text, trained in segments:
        if not colour and trained:
            text = f"[[{text}]]"
        characters.extend((char, trained and colour) for char in text)
    lines: list[tuple[str, int]] = []
    current: list[tuple[str, bool]] = []

    def flush() -> None:
        text, open_green = "", False
        for char, green in current:
            if green != open_green:
                text += _GREEN if green else _RESET
                open_green = green
            text += char
        lines.append((text + (_RESET if open_green else ""), len(current)))
        current.clear()

    for char, green in characters:
        if char == "\n":
            flush()
            continue
        current.append((char, green))
        if len(current) == width:
            flush()
    flush()
    return lines


def _padded(line: tuple[str, int], width: int) -> str:
    """`line` padded to `width` visible characters (colour codes take no room)."""
    text, visible = line
    return text + " " * (width - visible)


def side_by_side(
    tokenizer: Any,
    chosen: tuple[list[int], list[int]],
    rejected: tuple[list[int], list[int]],
    width: int,
    colour: bool,
) -> str:
    """The shared prompt, then chosen | rejected completions in two columns of `width` // 2 characters."""
    shared = common_prefix_length(chosen[0], rejected[0])
    prompt_end = min(shared, next(i for i, label in enumerate(chosen[1]) if label != IGNORE_INDEX))
    prompt = tokenizer.decode(chosen[0][:prompt_end])
    column = max(20, (width - 3) // 2)
    left = _lines(_segments(tokenizer, chosen[0][prompt_end:], chosen[1][prompt_end:]), column, colour)
    right = _lines(_segments(tokenizer, rejected[0][prompt_end:], rejected[1][prompt_end:]), column, colour)
    rows = [f"{'chosen'.ljust(column)} | rejected", f"{'-' * column} | {'-' * column}"]
    for number in range(max(len(left), len(right))):
        a = _padded(left[number], column) if number < len(left) else " " * column
        b = right[number][0] if number < len(right) else ""
        rows.append(f"{a} | {b}".rstrip())
    return textwrap.indent(prompt, "  ").rstrip("\n") + "\n" + "\n".join(rows)


def marked_text(tokenizer: Any, input_ids: list[int], labels: list[int], colour: bool) -> str:
    """The sequence's text with each run of trained tokens marked."""
    marks = (_GREEN, _RESET) if colour else ("[[", "]]")
    return "".join(
        f"{marks[0]}{text}{marks[1]}" if trained else text for text, trained in _segments(tokenizer, input_ids, labels)
    )
