"""Generated tokens -> text pieces safe to stream, and stop sequences.

The text of a request is always `decode(tokens)` of everything generated so far; the server decodes as
`finetune generate` prints (`skip_special_tokens=True`), so streamed pieces add up to the non-streamed text.
A piece is held back while it ends in an incomplete UTF-8 character (decoded as U+FFFD, which a later
byte-level token completes) or in the beginning of a stop sequence; a stop sequence ends the text
before it, and is not part of it (as in the OpenAI API).

Example:
    stream = TextStream(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), stop=["\\n\\n"])
    for token in tokens:
        piece = stream.push(token)     # "" while held back
        if stream.stopped: break
    rest = stream.finish()             # pieces + rest == stream.text
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"


class TextStream:
    """Text of one request's generated tokens, released piece by piece."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._tokens: list[int] = []
        self._text = ""
        self._sent = 0  # characters of `_text` already released
        self.stopped = False

    @property
    def text(self) -> str:
        """The text so far (cut before a stop sequence once one appeared)."""
        return self._text

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text that is safe to release (maybe "")."""
        self._tokens.append(token_id)
        self._text = self._decode(self._tokens)
        settled = self._settled_length()
        cut = self._first_stop(settled)
        if cut is not None:
            self._text, self.stopped = self._text[:cut], True
            return self._release(len(self._text))
        return self._release(settled - self._stop_prefix_length(settled))

    def _settled_length(self) -> int:
        """Length of the text before its trailing U+FFFD, which a later token may turn into another character.
        Stop sequences are looked for, and held back, in this text only: the hold-back was measured on the text
        with its U+FFFD, which no stop sequence begins, so in " rank\ufffd" the "k" of the stop "k\u0533 up" was
        released, and the stop, complete one token later, was never found."""
        settled = len(self._text)
        while settled > self._sent and self._text[settled - 1] == REPLACEMENT_CHARACTER:
            settled -= 1
        return settled

    def finish(self) -> str:
        """Everything not released yet: the request is over."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        piece, self._sent = self._text[self._sent : end], end
        return piece

    def _first_stop(self, end: int) -> int | None:
        """Where the earliest stop sequence starts in the unreleased text up to `end`, or None."""
        found = [at for stop in self._stop if (at := self._text.find(stop, self._sent, end)) >= 0]
        return min(found) if found else None

    def _stop_prefix_length(self, end: int) -> int:
        """Length of the longest end of the text up to `end` that could begin a stop sequence."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, end - self._sent), longest, -1):
                if self._text.endswith(stop[:length], 0, end):
                    longest = length
                    break
        return longest
