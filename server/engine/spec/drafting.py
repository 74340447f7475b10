"""Drafts for speculative decoding, made without a model: prompt lookup (n-gram matching).

A row's recent tokens (its prompt, a session's tail, what it generated) are searched for the latest earlier
occurrence of its last n tokens (n = `max_match` down to `min_match`); the tokens that followed it there are
the draft. Text that quotes or repeats its context — code edits, extraction, summaries, a small model's
loops — is drafted well; elsewhere the search finds nothing and the row verifies no draft.

The history is bounded (`window` tokens, in a fixed buffer): nothing grows with a row's length.
"""

from __future__ import annotations

import numpy as np

WINDOW = 2048  # tokens searched, at most
MAX_MATCH, MIN_MATCH = 3, 1


class NgramDrafter:
    """A row's bounded recent tokens and the prompt-lookup search over them."""

    def __init__(self, context: list[int], window: int = WINDOW, eos_ids: frozenset[int] = frozenset()) -> None:
        self.window, self.eos_ids = window, eos_ids
        self.buffer = np.zeros(2 * window, dtype=np.int64)  # the newest `length` tokens start at 0
        self.length = 0
        self.extend(context[-window:])

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.push(token)

    def push(self, token: int) -> None:
        if self.length == len(self.buffer):  # full: keep the newest `window` (amortised O(1) per token)
            self.buffer[: self.window] = self.buffer[self.length - self.window : self.length]
            self.length = self.window
        self.buffer[self.length] = token
        self.length += 1

    def recent(self, n: int) -> list[int]:
        """The newest n tokens (fewer if it holds fewer)."""
        return self.buffer[max(0, self.length - n) : self.length].tolist()

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the newest n-gram (longest n first);
        never an end-of-text token (a draft stops before one: the row's end is chosen, never drafted)."""
        history = self.buffer[max(0, self.length - self.window) : self.length]
        for n in range(MAX_MATCH, MIN_MATCH - 1, -1):
            if len(history) <= n:
                continue
            tail = history[-n:]
            # starts i < len - n whose n tokens equal the tail (the tail itself excluded)
            hits = np.ones(len(history) - n, dtype=bool)
            for offset in range(n):
                hits &= history[offset : len(history) - n + offset] == tail[offset]
            found = np.flatnonzero(hits)
            if len(found):
                whole = found[found + n + k <= len(history)]  # the latest with a whole draft after it, if any
                start = int(whole[-1] if len(whole) else found[-1]) + n
                draft = history[start : start + k].tolist()
                draft = until_end(draft, self.eos_ids)
                if draft:
                    return draft
        return []


def until_end(draft: list[int], eos_ids: frozenset[int]) -> list[int]:
    """The draft up to (not including) its first end-of-text token, of any of the model's ids."""
    end = next((i for i, token in enumerate(draft) if token in eos_ids), None)
    return draft if end is None else draft[:end]
