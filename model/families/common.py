"""What the families share, below them all (no import cycle): the refusal every family raises, fla's rotary
position embedding, and the one position a row's logits are wanted at."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


class UnsupportedCheckpoint(ValueError):
    """A checkpoint linserve will not serve: names the field, the value and what is supported."""

    def __init__(self, field_name: str, value, supported: str) -> None:
        super().__init__(f"config.json: {field_name}={value!r} is not served: {supported}")
        self.field_name, self.value = field_name, value


def at_positions(x: Tensor, positions: Tensor | None) -> Tensor:
    """x (B, T, C) at each row's one position (B,) → (B, C); None: x as it is. Before the final norm and the head,
    which are row by row (the exact projection's rows are the same bits in any batch: model/kernels/
    invariant_linear.cpp), so a prompt chunk's last logits are the bits of the whole chunk's, for 1/T the head."""
    if positions is None:
        return x
    return x[torch.arange(x.shape[0], device=x.device), positions]  # (B, C)


def rope_cos_sin(positions: Tensor, dim: int, base: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fla's RotaryEmbedding angles at absolute `positions` (B, T): cos and sin (B, T, 1, dim/2), computed in
    float64 and rounded once to `dtype`."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    angles = (positions.float()[..., None] * inv_freq).double()  # (B, T, dim/2)
    return angles.cos().to(dtype)[:, :, None], angles.sin().to(dtype)[:, :, None]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of x's last dimension (GPT-NeoX layout): [x₁cos − x₂sin, x₂cos + x₁sin]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
