"""Prefix cache for stateless requests: states snapshotted at chunk boundaries of recent prompts.

Keys chain block hashes (hash of block k covers every token before it), so a lookup walks the prompt's
boundaries once. Every entry costs the same bytes, one session state, whatever the prefix length.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch


def boundary_hashes(tokens: list[int], block: int) -> list[tuple[int, bytes]]:
    """(end, key) for every full block boundary end <= len(tokens)."""
    out, digest = [], b""
    for end in range(block, len(tokens) + 1, block):
        chunk = ",".join(map(str, tokens[end - block : end])).encode()
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

    def lookup(self, tokens: list[int]) -> tuple[int, dict[str, torch.Tensor] | None]:
        """Longest cached prefix strictly shorter than tokens (one token is always left to prefill)."""
        self.queries += 1
        if self.capacity == 0:
            return 0, None
        best_end, best = 0, None
        for end, key in boundary_hashes(tokens[:-1], self.block):
            entry = self._entries.get(key)
            if entry is None:
                break
            best_end, best = end, entry
            self._entries.move_to_end(key)
        if best is not None:
            self.hits += 1
        return best_end, best

    def insert(self, key: bytes, tensors: dict[str, torch.Tensor]) -> None:
        if self.capacity == 0 or key in self._entries:
            return
        self._entries[key] = tensors
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
