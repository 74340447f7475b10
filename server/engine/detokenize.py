"""Incremental detokenization and stop-string matching, never re-decoding the whole sequence per token."""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # tokens of already-emitted text decoded again for context (byte-level merges)
MAX_HELD_TOKENS = 8  # a UTF-8 character spans at most 4 bytes: past this, held bytes are emitted as U+FFFD


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each call decodes only the tokens since the last emitted text plus a few before them, and holds
    back text that ends in an incomplete UTF-8 character until the next token completes it. Only that
    window of ids is kept: its size does not grow with the sequence.
    """

    def __init__(self, decoder: Decoder, skip_ids: frozenset[int] = frozenset(), context: list[int] = ()) -> None:
        self.decoder = decoder
        self.skip_ids = skip_ids
        self.ids: list[int] = [t for t in context if t not in skip_ids]  # already-seen text, never emitted
        if self.ids and decoder.decode(self.ids).endswith(REPLACEMENT):
            self.ids = []  # context that ends inside a character cannot anchor the next delta
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.ids)  # tokens up to here are already emitted as text

    def add(self, token_id: int) -> str:
        if token_id in self.skip_ids:
            return ""
        self.ids.append(token_id)
        prefix_text = self.decoder.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.decoder.decode(self.ids[self.prefix_offset :])
        held = len(self.ids) - self.read_offset
        if (full_text.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS) or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character: wait for the next token
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)
        if self.prefix_offset:  # drop ids before the window: nothing will decode them again
            del self.ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return delta


class StopMatcher:
    """Finds stop strings in streamed text; withholds any tail that could still become one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""  # text received but not yet released

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit). After a hit, nothing more."""
        self.pending += text
        if self.stops:
            hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
            if hits:
                out, self.pending = self.pending[: min(hits)], ""
                return out, True
        cut = max(0, len(self.pending) - self.hold) if self.stops else len(self.pending)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The withheld tail, released when the sequence ends for another reason."""
        out, self.pending = self.pending, ""
        return out
