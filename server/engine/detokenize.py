"""Incremental detokenization and stop-string matching, never re-decoding the whole sequence per token."""

from __future__ import annotations

import json
import logging
import random
from codecs import utf_8_decode
from typing import Protocol

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # tokens of already-emitted text decoded again for context (byte-level merges)
MAX_HELD_TOKENS = 8  # a UTF-8 character spans at most 4 bytes: past this, held bytes are emitted as U+FFFD


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class ByteLevelDecoder:
    """A byte-level BPE tokenizer's decoding (GPT-2's family: every token a fixed string of bytes, the text their
    concatenation as UTF-8, malformed bytes as U+FFFD) from a table of each token's bytes: a token's text costs a
    lookup and an incremental UTF-8 decode instead of two calls into the tokenizer. `of` builds one only where
    the table reproduces the tokenizer's own `decode` — every single token, and random sequences — else None."""

    CHECKED_SEQUENCES = 64

    def __init__(self, decoder, table: list[bytes]) -> None:
        self.decoder, self.table = decoder, table

    def decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids)

    @classmethod
    def of(cls, decoder) -> ByteLevelDecoder | None:
        table = byte_level_table(decoder)
        if table is None:
            return None
        ids = list(range(len(table)))
        generator = random.Random(0)
        cases = [[i] for i in ids] + [generator.choices(ids, k=generator.randint(2, 12))
                                      for _ in range(cls.CHECKED_SEQUENCES)]
        expected = decoder.decode_batch(cases)
        for case, text in zip(cases, expected):
            if b"".join(table[i] for i in case).decode("utf-8", errors="replace") != text:
                logger.info("the tokenizer's decoding is not its tokens' bytes (%r): detokenizing through it", case)
                return None
        return cls(decoder, table)


def byte_level_table(decoder) -> list[bytes] | None:
    """Each id's bytes for a `tokenizers.Tokenizer` whose model is BPE and whose decoder is ByteLevel alone (no
    normalizer); special tokens decode to nothing (as `decode` skips them), other added tokens to their text.
    None for anything else."""
    try:
        spec = json.loads(decoder.to_str())
    except Exception:  # noqa: BLE001 - not a tokenizers.Tokenizer
        return None
    if (spec.get("decoder") or {}).get("type") != "ByteLevel" or spec.get("normalizer") is not None \
            or (spec.get("model") or {}).get("type") != "BPE":
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte → printable character

    characters = {character: byte for byte, character in bytes_to_unicode().items()}
    size = decoder.get_vocab_size(with_added_tokens=True)
    added = {token["id"]: token for token in spec.get("added_tokens", [])}
    table = []
    for i in range(size):
        if i in added:
            table.append(b"" if added[i]["special"] else added[i]["content"].encode())
            continue
        piece = decoder.id_to_token(i)
        if piece is None or any(c not in characters for c in piece):
            return None
        table.append(bytes(characters[c] for c in piece))
    return table


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each call decodes only the tokens since the last emitted text plus a few before them, and holds
    back text that ends in an incomplete UTF-8 character until the next token completes it. Only that
    window of ids is kept: its size does not grow with the sequence. (Slots: a row's step reads it, every step.)
    """

    __slots__ = ("decoder", "skip_ids", "table", "held", "add", "ids", "prefix_offset", "read_offset")

    def __init__(self, decoder: Decoder, skip_ids: frozenset[int] = frozenset(), context: list[int] = ()) -> None:
        self.decoder = decoder
        self.skip_ids = skip_ids
        self.table = getattr(decoder, "table", None)  # a ByteLevelDecoder's: bytes per token, decoded as they come
        # (with a table, a character split across context and this text is U+FFFD either way: the tokenizer
        # decodes the text alone)
        if self.table is not None:
            self.held = b""  # the bytes of an unfinished character, until the next token's complete it
            self.add = self._add_bytes
            return
        self.add = self._add_ids
        self.ids: list[int] = [t for t in context if t not in skip_ids]  # already-seen text, never emitted
        if self.ids and decoder.decode(self.ids).endswith(REPLACEMENT):
            self.ids = []  # context that ends inside a character cannot anchor the next delta
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.ids)  # tokens up to here are already emitted as text

    def _add_ids(self, token_id: int) -> str:
        """A token's text delta, decoded through the tokenizer with its window of context (`add` without a table)."""
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

    def _add_bytes(self, token_id: int) -> str:
        """What an incremental UTF-8 decoder ("replace") gives, without its Python `decode` method: the C decode
        consumes all but an unfinished character's bytes, which wait for the next token's (a row, every step)."""
        if token_id in self.skip_ids:
            return ""
        data = self.table[token_id]
        if self.held:
            data = self.held + data
        text, used = utf_8_decode(data, "replace", False)
        self.held = data[used:]
        return text


class StopMatcher:
    """Finds stop strings in streamed text; withholds any tail that could still become one."""

    __slots__ = ("stops", "hold", "pending")

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
