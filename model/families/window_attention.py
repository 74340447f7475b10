"""Hybrid models' softmax layers with a sliding window (fla's `attn` section with `window_size` set): each
query attends to itself and the W − 1 tokens before it, so a session keeps only the last W keys and values —
a fixed-size state like the linear layers' (design invariant 4). A full softmax layer (window_size null)
keeps a cache that grows with the context: refused at start (`read_window_layers`).

fla's `Attention` layer, as linserve computes it: q/k/v projections (qkv_bias), RoPE at absolute positions
(halves rotated, base rope_theta, over the whole head), grouped kv heads, softmax with scale head_dim^-½, o_proj.
State per layer: `keys`, `values` (W, kv_heads·head_dim) fp32, oldest first, and `position` (int64, tokens
seen). Prompts run in query blocks (each block's keys are the W before it and the block itself); the exact
bf16 path runs query by query with fixed-order sums, so a row's bits do not depend on its batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from .. import numerics
from .common import UnsupportedCheckpoint, rope_cos_sin, rotate

if TYPE_CHECKING:
    from .fla_base import FlaConfig

QUERY_BLOCK = 128  # queries per block of a prompt: scores (B, H, 128, W + 128)


def read_window_layers(attn, n_layers: int, hidden: int) -> dict[int, dict]:
    """fla's `attn` section (a spec or a list of specs) → layer index → spec with fla's defaults; refuses a
    full softmax layer and what fla itself would refuse, naming the field."""
    if attn is None:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise UnsupportedCheckpoint("attn", attn, "null, an attention spec or a list of them")
    layers: dict[int, dict] = {}
    for spec in specs:
        window = spec.get("window_size")
        if window is None:
            raise UnsupportedCheckpoint("attn.window_size", window, "a full softmax layer keeps a KV cache that "
                                        "grows with the context; served hybrids set window_size (a fixed window)")
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise UnsupportedCheckpoint("attn.window_size", window, "a positive integer")
        heads = spec.get("num_heads")
        kv_heads = spec.get("num_kv_heads") or heads
        if not isinstance(heads, int) or heads <= 0 or hidden % heads or not isinstance(kv_heads, int) or (
                kv_heads <= 0 or heads % kv_heads):
            raise UnsupportedCheckpoint("attn.num_heads", heads, f"a divisor of hidden_size ({hidden}), "
                                        "num_kv_heads a divisor of it")
        theta = spec.get("rope_theta", 10000.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise UnsupportedCheckpoint("attn.rope_theta", theta, "a positive number")
        for index in spec.get("layers") or []:
            if not isinstance(index, int) or not 0 <= index < n_layers or index in layers:
                raise UnsupportedCheckpoint("attn.layers", spec.get("layers"),
                                            f"distinct layer indices in [0, {n_layers})")
            layers[index] = dict(num_heads=heads, num_kv_heads=kv_heads, qkv_bias=bool(spec.get("qkv_bias", False)),
                                 window_size=window, rope_theta=float(theta))
    return layers


def window_state_shapes(config: FlaConfig, spec: dict) -> dict[str, tuple[int, ...]]:
    kv_dim = spec["num_kv_heads"] * (config.hidden_size // spec["num_heads"])
    return {"keys": (spec["window_size"], kv_dim), "values": (spec["window_size"], kv_dim), "position": ()}


class SlidingWindowAttention(nn.Module):
    """fla's Attention (parameter names q_proj, k_proj, v_proj, o_proj) over a window of W tokens."""

    def __init__(self, config: FlaConfig, spec: dict) -> None:
        super().__init__()
        C = config.hidden_size
        self.heads, self.kv_heads = spec["num_heads"], spec["num_kv_heads"]
        self.head_dim = C // self.heads
        self.window, self.rope_theta = spec["window_size"], spec["rope_theta"]
        kv_dim = self.kv_heads * self.head_dim
        self.q_proj = nn.Linear(C, C, bias=spec["qkv_bias"])
        self.k_proj = nn.Linear(C, kv_dim, bias=spec["qkv_bias"])
        self.v_proj = nn.Linear(C, kv_dim, bias=spec["qkv_bias"])
        self.o_proj = nn.Linear(C, C, bias=False)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], exact: bool,
                prefixes: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        B, T, C = x.shape
        W, hd, kv = self.window, self.head_dim, self.kv_heads
        start = state["position"]  # (B,) int64: tokens seen
        positions = start[:, None] + torch.arange(T, device=x.device)  # (B, T)
        cos, sin = rope_cos_sin(positions, hd, self.rope_theta, x.dtype)  # (B, T, 1, hd/2) each
        q, k, v = numerics.project_all([self.q_proj, self.k_proj, self.v_proj], x)  # (B, T, ·) each
        q = rotate(q.view(B, T, self.heads, hd), cos, sin)  # (B, T, H, hd)
        k = rotate(k.view(B, T, kv, hd), cos, sin)  # (B, T, kv, hd)
        keys = torch.cat([state["keys"], k.reshape(B, T, kv * hd).float()], dim=1)  # (B, W+T, kv·hd), oldest first
        values = torch.cat([state["values"], v.float()], dim=1)  # (B, W+T, kv·hd)
        first_valid = W - torch.clamp(start, max=W)  # (B,): slots before it were never written
        attend = self.attend_exact if exact else self.attend_blocks
        o = attend(q.float() * hd ** -0.5, keys.view(B, W + T, kv, hd), values.view(B, W + T, kv, hd),
                   first_valid)  # (B, T, H, hd) fp32
        new = {}
        if prefixes:  # the window after each prefix: slots t+1 … t+W of the concatenation
            new["keys"] = keys.unfold(1, W, 1)[:, 1:].transpose(-1, -2)  # (B, T, W, kv·hd)
            new["values"] = values.unfold(1, W, 1)[:, 1:].transpose(-1, -2)  # (B, T, W, kv·hd)
            new["position"] = positions + 1  # (B, T)
        else:
            new["keys"], new["values"], new["position"] = keys[:, T:], values[:, T:], start + T
        return numerics.project(self.o_proj, o.to(x.dtype).reshape(B, T, C)), new  # (B, T, C)

    def grouped(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, kv, hd) → (B, N, H, hd): query head h reads kv head h // (H / kv)."""
        return t if self.kv_heads == self.heads else t.repeat_interleave(self.heads // self.kv_heads, dim=2)

    def attend_blocks(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      first_valid: torch.Tensor) -> torch.Tensor:
        """Blocks of queries with matrix products. Query i (0-based in the call) reads concatenation slots
        i+1 … i+W, those at or after first_valid."""
        B, T, H, hd = q.shape
        W = self.window
        outs = []
        for a in range(0, T, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, T)
            k = self.grouped(keys[:, a + 1:W + b]).transpose(1, 2)  # (B, H, W+b-a-1, hd)
            v = self.grouped(values[:, a + 1:W + b]).transpose(1, 2)  # (B, H, W+b-a-1, hd)
            slot = torch.arange(a + 1, W + b, device=q.device)  # (N,) concatenation slots
            query = torch.arange(a, b, device=q.device)[:, None]  # (b-a, 1)
            visible = (slot > query) & (slot <= query + W)  # (b-a, N)
            visible = visible[None] & (slot >= first_valid[:, None, None])  # (B, b-a, N)
            scores = q[:, a:b].transpose(1, 2) @ k.transpose(-1, -2)  # (B, H, b-a, N)
            scores = scores.masked_fill(~visible[:, None], float("-inf"))
            outs.append((scores.softmax(-1) @ v).transpose(1, 2))  # (B, b-a, H, hd)
        return torch.cat(outs, dim=1)

    def attend_exact(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     first_valid: torch.Tensor) -> torch.Tensor:
        """Query by query, fixed-order sums (numerics.tree_sum) and float64 exp: a row's bits are its own."""
        B, T, H, hd = q.shape
        W = self.window
        slot = torch.arange(1, W + 1, device=q.device)  # (W,) relative to each query
        outs = []
        for i in range(T):
            k = self.grouped(keys[:, i + 1:i + 1 + W])  # (B, W, H, hd)
            v = self.grouped(values[:, i + 1:i + 1 + W])  # (B, W, H, hd)
            scores = numerics.tree_sum(q[:, i, None] * k, -1)  # (B, W, H)
            visible = (slot + i)[None] >= first_valid[:, None]  # (B, W)
            scores = scores.masked_fill(~visible[..., None], float("-inf"))
            weights = numerics.exp(scores - scores.amax(1, keepdim=True))  # (B, W, H)
            total = numerics.tree_sum(weights, 1)  # (B, H)
            outs.append(numerics.tree_sum(weights[..., None] * v, 1) / total[..., None])  # (B, H, hd)
        return torch.stack(outs, dim=1)  # (B, T, H, hd)
