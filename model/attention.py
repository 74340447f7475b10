"""Attention modules with one interface: `forward(x, state) -> (y, state)`, for a chunk or one token."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import numerics
from .config import ModelConfig
from .feature_maps import FeatureMap
from .linear_attention import chunked_forward, read_pooled, recurrent_step, scan
from .pooled_state import gathered, readable
from .state import KVCacheState, LinearAttentionState


def head_log_decays(config: ModelConfig) -> torch.Tensor:
    """log γ_h with γ_h = 1 - 2^(-5 - 4h/H): slow heads remember ~thousands of tokens, fast ones ~32. Computed on
    the CPU, then put where the module is being built (on the meta device, `arange`'s Python reference would
    import torch._dynamo: a second of a server's start)."""
    exponents = -5.0 - 4.0 * torch.arange(config.n_heads, dtype=torch.float64, device="cpu") / config.n_heads  # (H,)
    return torch.log1p(-torch.pow(2.0, exponents)).float().to(torch.get_default_device())  # (H,)


class _Heads(nn.Module):
    """Shared q/k/v and output projections, and the head split."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.d_model, 3 * config.d_attn, bias=False)
        self.proj = nn.Linear(config.d_attn, config.d_model, bias=False)
        if config.decay:
            self.register_buffer("log_decay", head_log_decays(config), persistent=True)  # (H,) saved: HF loads on meta
        else:
            self.log_decay = None

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x.shape
        H, dh = self.config.n_heads, self.config.d_head
        qkv = numerics.project(self.qkv, x).view(B, T, 3, H, dh)  # (B, T, 3, H, dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, dh)
        return q, k, v

    def merge(self, o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        B, H, T, dh = o.shape
        return numerics.project(self.proj, o.transpose(1, 2).reshape(B, T, H * dh).to(dtype))  # (B, T, C)


class LinearAttention(_Heads):
    """Causal linear attention; state (S, z) in fp32 whatever the weights' dtype."""

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__(config)
        self.feature_map = FeatureMap(config, layer_index)

    def init_state(self, batch: int, device: torch.device | str) -> LinearAttentionState:
        c = self.config
        return LinearAttentionState(
            S=torch.zeros(batch, c.n_heads, c.d_feature, c.d_head, device=device, dtype=torch.float32),
            z=torch.zeros(batch, c.n_heads, c.d_feature, device=device, dtype=torch.float32),
        )

    def forward(
        self,
        x: torch.Tensor,
        state: LinearAttentionState | None,
        key_mask: torch.Tensor | None = None,
        prefixes: bool = False,
    ) -> tuple[torch.Tensor, LinearAttentionState]:
        """x (B, T, C); key_mask (B, T) with 0 at positions that must not enter the state (padding).
        `prefixes`: the returned state is the one after every prefix, S (B, T, H, dk, dv), z (B, T, H, dk)."""
        if state is None:
            state = self.init_state(x.shape[0], x.device)
        q, k, v = self.split(x)  # (B, H, T, dh)
        if torch.is_autocast_enabled(x.device.type):  # the state maths stays fp32 under autocast
            with torch.autocast(device_type=x.device.type, enabled=False):
                o, S, z = self._attend(q, k, v, state, key_mask, prefixes)
        else:
            o, S, z = self._attend(q, k, v, state, key_mask, prefixes)
        return self.merge(o, x.dtype), LinearAttentionState(S=S, z=z)

    def _attend(self, q, k, v, state: LinearAttentionState, key_mask: torch.Tensor | None, prefixes: bool = False):
        """(B, H, T, dh) projections → o (B, H, T, dv) fp32 and the new (S, z): `recurrent_step` at T = 1; the
        state after every prefix (speculative decoding) and bf16 inference (`numerics.exact_inference`) by
        `scan` — the recurrence's own bits, however the sequence was split or batched; else (training, fp32)
        the parallel chunked form."""
        phi_q = self.feature_map(q, is_query=True)  # (B, H, T, dk) fp32
        phi_k = self.feature_map(k, is_query=False)  # (B, H, T, dk) fp32
        if key_mask is not None:
            phi_k = phi_k * key_mask[:, None, :, None].float()  # (B, H, T, dk)
        v = v.float()  # (B, H, T, dv)
        if readable(state.S, q.shape[2], prefixes):
            o, S, z = read_pooled(phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], state.S, state.z, self.log_decay,
                                  self.config.eps)  # S: the update, pending (pooled_state.py)
            return o[:, :, None], S, z  # (B, H, 1, dv)
        S = gathered(state.S)  # (B, H, dk, dv)
        if q.shape[2] == 1 and not prefixes:
            o, S, z = recurrent_step(phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0], S, state.z, self.log_decay,
                                     self.config.eps)
            return o[:, :, None], S, z  # (B, H, 1, dv)
        if prefixes or numerics.exact_inference(q):  # prefixes: S (B, T, H, dk, dv), z (B, T, H, dk)
            return scan(phi_q, phi_k, v, S, state.z, self.log_decay, self.config.eps, prefixes)
        return chunked_forward(phi_q, phi_k, v, S, state.z, self.log_decay, self.config.chunk_size,
                               self.config.eps)


class SoftmaxAttention(_Heads):
    """Causal softmax attention with a per-sequence KV cache: the baseline linserve is measured against.

    With `decay`, scores get the bias (i - j)·log γ_h (ALiBi), the softmax twin of linear decay.
    """

    def init_state(self, batch: int, device: torch.device | str) -> KVCacheState:
        c = self.config
        empty = torch.zeros(batch, c.n_heads, 0, c.d_head, device=device, dtype=self.qkv.weight.dtype)
        return KVCacheState(k=empty, v=empty.clone())

    def forward(
        self,
        x: torch.Tensor,
        state: KVCacheState | None,
        key_mask: torch.Tensor | None = None,
        prefixes: bool = False,
    ) -> tuple[torch.Tensor, KVCacheState]:
        if prefixes:
            raise ValueError("the state after every prefix is a linear-attention form (speculative decoding)")
        if key_mask is not None and not bool(key_mask.all()):
            raise ValueError("padding masks are supported for linear attention only")
        B, T, _ = x.shape
        q, k, v = self.split(x)  # (B, H, T, dh)
        valid = None
        if state is not None and state.k.shape[2] > 0:
            k = torch.cat([state.k.to(k.dtype), k], dim=2)  # (B, H, P+T, dh)
            v = torch.cat([state.v.to(v.dtype), v], dim=2)  # (B, H, P+T, dh)
            if state.valid is not None:
                new = torch.ones(B, T, dtype=torch.bool, device=x.device)
                valid = torch.cat([state.valid, new], dim=1)  # (B, P+T)
        past = k.shape[2] - T
        query_pos = torch.arange(past, past + T, device=x.device)  # (T,)
        key_pos = torch.arange(past + T, device=x.device)  # (P+T,)
        distance = (query_pos[:, None] - key_pos[None, :]).float()  # (T, P+T)
        bias = torch.where(distance >= 0, 0.0, -math.inf)  # (T, P+T)
        if self.log_decay is not None:
            bias = bias + self.log_decay[:, None, None] * distance.clamp(min=0)  # (H, T, P+T)
        if valid is not None:  # left padding: rows' real keys are contiguous at the end, so distances hold
            bias = bias + torch.where(valid, 0.0, -math.inf)[:, None, None, :]  # (B, H|1, T, P+T)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))  # (B, H, T, dh)
        return self.merge(o, x.dtype), KVCacheState(k=k, v=v, valid=valid)


def build_attention(config: ModelConfig, layer_index: int) -> nn.Module:
    if config.attention == "linear":
        return LinearAttention(config, layer_index)
    return SoftmaxAttention(config)
