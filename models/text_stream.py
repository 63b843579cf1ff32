"""Incremental detokenization: text pieces to print as token ids arrive, whole characters only.

A byte-level BPE token can hold part of a multi-byte UTF-8 character; decoding a prefix that ends inside one
gives U+FFFD. ``TextStream`` holds such tokens back until the character completes. It decodes a short window
(from the last emitted boundary) rather than the whole sequence, so each step costs O(window), and the
concatenated pieces equal ``decode(all ids)`` for byte-level tokenizers (checked in tests/models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

REPLACEMENT = "\ufffd"


class TextStream:
    """``push(ids) -> str`` returns the new text the ids complete; ``flush() -> str`` the rest at the end.

    decode: ids (list of ints) -> text, e.g. ``lambda ids: processor.decode(ids)`` (special tokens skipped).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        if not callable(decode):
            raise ValueError(f"decode: expected a callable ids -> str, got {type(decode).__name__}")
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it have been emitted and are no longer decoded
        self.read = 0    # ids before it have been emitted

    def push(self, ids: Iterable[int]) -> str:
        """Append ``ids`` (ints); return the text that is now complete (may be empty)."""
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        done = self.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        text = self.decode(self.ids[self.prefix:])
        if not final and (text.endswith(REPLACEMENT) or len(text) <= len(done) or not text.startswith(done)):
            return ""  # an unfinished character, nothing new yet, or text of the window not settled
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]
