"""Positive feature maps φ for linear attention: ELU+1, ReLU+eps and FAVOR+ random features."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import numerics
from .config import ModelConfig


def draw_orthogonal_features(n_features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """FAVOR+ projection (m, d): stacked orthogonal blocks, rows rescaled to chi(d)-distributed norms."""
    blocks = []
    for _ in range(math.ceil(n_features / dim)):
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)  # (d, d)
        q, _ = torch.linalg.qr(gaussian)  # (d, d) orthonormal columns
        blocks.append(q.T)  # rows orthonormal
    rows = torch.cat(blocks, dim=0)[:n_features]  # (m, d)
    norms = torch.randn(n_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)  # (m,)
    return (rows * norms[:, None]).float()  # (m, d)


def elu1(x: torch.Tensor) -> torch.Tensor:
    """ELU(x) + 1: x + 1 above 0, exp(x) below (`numerics.exp`: the same bits on every backend)."""
    return torch.where(x > 0, x + 1.0, numerics.exp(torch.clamp(x, max=0.0)))


class FeatureMap(nn.Module):
    """φ applied per head to (B, H, T, d) queries or keys; returns (B, H, T, d_feature) in fp32.

    FAVOR+ keeps its projection as a persistent buffer: drawn once at construction from the config's
    seed, saved with the weights, loaded back and never redrawn at inference.
    """

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.kind = config.feature_map
        self.eps = config.eps
        self.d_head = config.d_head
        if self.kind == "favor":
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + layer_index)
            projection = draw_orthogonal_features(config.favor_features, config.d_head, generator)
            self.register_buffer("projection", projection, persistent=True)  # (m, d)

    def forward(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        exact = numerics.exact_inference(x)
        if self.kind == "elu1" and exact:  # a lookup: the same bits on every backend
            return numerics.lookup(numerics.bf16_table("elu1", elu1, torch.float32, x.device), x)  # (B, H, T, d)
        x = x if x.dtype == torch.float64 else x.float()  # (B, H, T, d): fp32 at least
        if self.kind == "elu1":
            return F.elu(x) + 1.0  # (B, H, T, d)
        if self.kind == "relu":
            return F.relu(x) + self.eps  # (B, H, T, d)
        return self._favor(x, is_query, exact)

    def _favor(self, x: torch.Tensor, is_query: bool, exact: bool) -> torch.Tensor:
        # softmax kernel exp(qᵀk/√d) ≈ φ(q)ᵀφ(k) with φ(x) = exp(Wx - |x|²/2)/√m on x/d^¼
        x = x * self.d_head**-0.25  # (B, H, T, d)
        projection = self.projection.to(x.dtype)  # (m, d)
        if exact:  # a token's features must not depend on how many tokens share the product (numerics.py)
            projected = numerics.tree_sum(x[..., None, :] * projection, -1)  # (B, H, T, m)
            log_phi = projected - 0.5 * numerics.tree_sum(x * x, -1)[..., None]  # (B, H, T, m)
        else:
            projected = x @ projection.T  # (B, H, T, m)
            log_phi = projected - 0.5 * (x * x).sum(dim=-1, keepdim=True)  # (B, H, T, m)
        if is_query:
            # a per-query constant cancels between numerator and denominator: subtract the row max
            log_phi = log_phi - log_phi.amax(dim=-1, keepdim=True).detach()  # (B, H, T, m)
        # keys need no stabiliser: wᵀx - |x|²/2 <= |w|²/2, a bound fixed by the saved projection
        features = numerics.exp(log_phi) if exact else torch.exp(log_phi)  # (B, H, T, m)
        return features / math.sqrt(projected.shape[-1])  # (B, H, T, m)
