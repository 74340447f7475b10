"""Token streams for training and evaluation: works joined by the end-of-text token, cached on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from .tokenizer import EOT_TOKEN


def encode_works(tokenizer: Tokenizer, works: dict[str, str]) -> np.ndarray:
    """[EOT] work₁ [EOT] work₂ … as one uint16 stream (EOT separates and opens every work)."""
    eot = tokenizer.token_to_id(EOT_TOKEN)
    pieces = []
    for text in works.values():
        pieces.append(np.array([eot], dtype=np.uint16))
        pieces.append(np.asarray(tokenizer.encode(text).ids, dtype=np.uint16))
    return np.concatenate(pieces)


def cached_tokens(tokenizer: Tokenizer, works: dict[str, str], cache_dir: Path, label: str) -> np.ndarray:
    """encode_works, cached under a key of the tokenizer and the texts."""
    key = hashlib.sha256(tokenizer.to_str().encode() + "".join(works).encode() + str(len(works)).encode())
    path = cache_dir / f"{label}-{key.hexdigest()[:16]}.npy"
    if path.is_file():
        return np.load(path)
    tokens = encode_works(tokenizer, works)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(path, tokens)
    return tokens


class WindowSampler:
    """Random windows of seq_len+1 tokens from a stream, drawn from a seeded generator (resumable)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the token stream ({len(tokens)}) is shorter than one window ({seq_len + 1})")
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]]  # (B, T+1)
        return windows[:, :-1], windows[:, 1:]  # inputs (B, T), targets (B, T)

    def get_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
