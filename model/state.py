"""Per-session recurrent state, passed explicitly through the model: `forward(x, state) -> (y, state)`.

A linear-attention model's state is a fixed set of fp32 tensors per layer — S (B, H, d_k, d_v),
z (B, H, d_k) and, with a short convolution, its window (B, W, d_model) — whose size never depends on
how many tokens were consumed. The softmax baseline's state is a KV cache that grows with them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class LinearAttentionState:
    S: Tensor  # (B, H, dk, dv) fp32
    z: Tensor  # (B, H, dk) fp32


@dataclass(frozen=True)
class KVCacheState:
    k: Tensor  # (B, H, T, dh)
    v: Tensor  # (B, H, T, dh)
    valid: Tensor | None = None  # (B, T) bool: False for left padding (rows of different lengths batched)


AttentionState = LinearAttentionState | KVCacheState


@dataclass(frozen=True)
class BlockState:
    attn: AttentionState
    conv: Tensor | None  # (B, W, d_model) fp32: the last W normalised inputs, W = conv_kernel - 1


@dataclass(frozen=True)
class ModelState:
    """The whole model's state for a batch of B sequences."""

    blocks: tuple[BlockState, ...]

    def tensors(self) -> dict[str, Tensor]:
        """Flat name → tensor view, e.g. {"blocks.0.S": …, "blocks.0.z": …, "blocks.0.conv": …}."""
        out: dict[str, Tensor] = {}
        for i, block in enumerate(self.blocks):
            for f in fields(block.attn):
                if getattr(block.attn, f.name) is not None:
                    out[f"blocks.{i}.{f.name}"] = getattr(block.attn, f.name)
            if block.conv is not None:
                out[f"blocks.{i}.conv"] = block.conv
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], n_layers: int, attention: str) -> ModelState:
        """Inverse of `tensors()`; raises KeyError naming a missing tensor."""
        attn_cls = LinearAttentionState if attention == "linear" else KVCacheState
        blocks = []
        for i in range(n_layers):
            attn = attn_cls(**{f.name: tensors[f"blocks.{i}.{f.name}"] for f in fields(attn_cls)
                               if f"blocks.{i}.{f.name}" in tensors or f.default is not None})
            blocks.append(BlockState(attn=attn, conv=tensors.get(f"blocks.{i}.conv")))
        return cls(blocks=tuple(blocks))

    def map(self, fn: Callable[[Tensor], Tensor]) -> ModelState:
        """A new state with `fn` applied to every tensor."""
        blocks = []
        for block in self.blocks:
            attn = replace(block.attn, **{f.name: fn(getattr(block.attn, f.name)) for f in fields(block.attn)
                                          if getattr(block.attn, f.name) is not None})
            conv = fn(block.conv) if block.conv is not None else None
            blocks.append(BlockState(attn=attn, conv=conv))
        return ModelState(blocks=tuple(blocks))

    def select_prefix(self, kept: Tensor) -> ModelState:
        """From a state after every prefix (each tensor (B, T, …), see `LinearGPT.forward(prefixes=True)`),
        row b's state after its first kept[b] + 1 tokens: kept (B,) int64 in [0, T)."""
        rows = torch.arange(kept.shape[0], device=kept.device)  # (B,)
        return self.map(lambda t: t[rows, kept])  # (B, …) each

    @property
    def is_linear(self) -> bool:
        return isinstance(self.blocks[0].attn, LinearAttentionState)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def clone(self) -> ModelState:
        return self.map(torch.clone)

    def to(self, device: torch.device | str) -> ModelState:
        return self.map(lambda t: t.to(device))
