"""Prefix cache for stateless requests: states snapshotted at chunk boundaries of recent prompts.

Keys chain block hashes (hash of block k covers every token before it), so a lookup walks the prompt's
boundaries once, and a request extends its own chain one block at a time as it prefills. Chains start
from a per-scope seed (the API key's owner id): one tenant's prompts never hit another's entries, so
cache timing reveals nothing across keys. Every entry costs the same bytes, one session state, whatever
the prefix length.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch


def scope_seed(owner: str | None) -> bytes:
    """The start of every key chain of one scope (no key = one shared scope)."""
    return hashlib.blake2b(f"linserve-prefix:{owner or ''}".encode(), digest_size=16).digest()


def boundary_hashes(tokens: list[int], block: int, seed: bytes) -> list[tuple[int, bytes]]:
    """(end, key) for every full block boundary end <= len(tokens), chained from `seed`."""
    out, digest = [], seed
    for end in range(block, len(tokens) + 1, block):
        chunk = array("q", tokens[end - block : end]).tobytes()
        digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
        out.append((end, digest))
    return out


class PrefixCache:
    def __init__(self, capacity: int, block: int, entry_bytes: int) -> None:
        self.capacity, self.block, self.entry_bytes = capacity, block, entry_bytes
        self._entries: OrderedDict[bytes, dict[str, torch.Tensor]] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_in_use(self) -> int:
        return len(self._entries) * self.entry_bytes

    def lookup(self, tokens: list[int], seed: bytes) -> tuple[int, bytes, dict[str, torch.Tensor] | None]:
        """Longest cached prefix strictly shorter than tokens (one token is always left to prefill):
        (its length, its chain key — `seed` for none — and its state)."""
        self.queries += 1
        best_end, best_key, best = 0, seed, None
        if self.capacity == 0:
            return best_end, best_key, best
        for end, key in boundary_hashes(tokens[:-1], self.block, seed):
            entry = self._entries.get(key)
            if entry is None:
                break
            best_end, best_key, best = end, key, entry
            self._entries.move_to_end(key)
        if best is not None:
            self.hits += 1
        return best_end, best_key, best

    def insert(self, key: bytes, tensors: dict[str, torch.Tensor]) -> None:
        if self.capacity == 0 or key in self._entries:
            return
        self._entries[key] = tensors
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
