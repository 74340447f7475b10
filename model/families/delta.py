"""The mixer fla's delta-rule families share (delta_net.py, gated_deltanet.py): q/k/v projections, each
optionally through a short convolution, q and k activated and normalised, a write strength β per value head
(and, gated, a decay), the delta rule (model/delta_rule.py), then a per-head RMSNorm — gated by an output
projection where the config says so — and the output projection:

    o = o_proj(RMSNorm(o) · act(g_proj(x)))   (use_gate)        o = o_proj(RMSNorm(o))   (else)

Heads: H query/key heads of d_k, HV value heads of d_v (HV a multiple of H: each q/k head serves HV/H
value heads — Gated DeltaNet's grouped values; DeltaNet has HV = H). The state per layer: S (HV, d_k, d_v)
and, with short convolutions, their windows — fixed sizes, fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import delta_rule, numerics
from .fla_base import FlaConfig, RMSNorm, ShortConvolution, UnsupportedCheckpoint, project_qkv

OUTPUT_GATES = {"swish": "silu", "silu": "silu", "sigmoid": "sigmoid"}  # fla's FusedRMSNormGated activations


def set_delta_shapes(config: FlaConfig, raw: dict, defaults: dict, value_heads: int, head_k: int,
                     head_v: int) -> None:
    """The options both families share, and the state shapes, onto `config`."""
    get = lambda name: raw.get(name, defaults.get(name))  # noqa: E731
    config.value_heads, config.head_k, config.head_v = value_heads, head_k, head_v
    config.use_gate = bool(get("use_gate"))
    config.use_short_conv = bool(get("use_short_conv"))
    config.conv_size = int(get("conv_size"))
    if config.use_short_conv and config.conv_size < 2:
        raise UnsupportedCheckpoint("conv_size", config.conv_size, "at least 2 with use_short_conv")
    config.allow_neg_eigval = bool(get("allow_neg_eigval"))
    config.state_shapes = {"S": (value_heads, head_k, head_v)}
    if config.use_short_conv:
        window = config.conv_size - 1
        config.state_shapes.update(conv_q=(window, config.key_dim), conv_k=(window, config.key_dim),
                                   conv_v=(window, config.value_dim))


class DeltaMixer(nn.Module):
    """Subclasses give `qk(q, k, exact)` (activation and normalisation, fp32 out), `beta(x)` (B, T, HV) and
    `gate(x)` (B, T, HV) log decay or None."""

    output_gate = "silu"
    pooled_state = ("S",)  # decoded from the pool in place (pooled_state.py)
    folded_state = ("S",)  # its commit noted for the next read (pooled_state.py)

    def __init__(self, config: FlaConfig, qk_conv_activation: str | None = "silu") -> None:
        super().__init__()
        self.config = config
        self.qk_conv_activation = qk_conv_activation  # q's and k's SiLU (in the convolution when there is one)
        C = config.hidden_size
        self.q_proj = nn.Linear(C, config.key_dim, bias=False)
        self.k_proj = nn.Linear(C, config.key_dim, bias=False)
        self.v_proj = nn.Linear(C, config.value_dim, bias=False)
        if config.use_short_conv:
            self.q_conv1d = ShortConvolution(config.key_dim, config.conv_size, False, self.qk_conv_activation)
            self.k_conv1d = ShortConvolution(config.key_dim, config.conv_size, False, self.qk_conv_activation)
            self.v_conv1d = ShortConvolution(config.value_dim, config.conv_size, False, "silu")
        if config.use_gate:
            self.g_proj = nn.Linear(C, config.value_dim, bias=False)
        self.o_norm = RMSNorm(config.head_v, config.norm_eps)
        self.o_proj = nn.Linear(config.value_dim, C, bias=False)

    def projections(self, x: torch.Tensor, state: dict, prefixes: bool, new: dict):
        """q, k, v (B, T, ·) and, where the layer has an output gate, its projection of x in the same call."""
        q, k, v, *g = project_qkv(self, x, state, prefixes, new, (self.g_proj,) if self.config.use_gate else ())
        if not self.config.use_short_conv:
            q, k = (self.unconvolved(t) for t in (q, k))
            v = numerics.activation("silu", v)
        return q, k, v, *g  # (B, T, ·) each

    def unconvolved(self, t: torch.Tensor) -> torch.Tensor:
        """q or k without a short convolution: SiLU where the convolution would have applied it."""
        return t if self.qk_conv_activation is None else numerics.activation(self.qk_conv_activation, t)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], exact: bool,
                prefixes: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        B, T, _ = x.shape
        H, HV = c.num_heads, c.value_heads
        new: dict[str, torch.Tensor] = {}
        q, k, v, *g = self.projections(x, state, prefixes, new)
        q, k = self.qk(q.view(B, T, H, c.head_k), k.view(B, T, H, c.head_k), exact)  # (B, T, H, dk) fp32 each
        if HV != H:  # each q/k head serves HV/H consecutive value heads
            q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)  # (B, T, HV, dk)
        beta = self.beta(x)  # (B, T, HV) fp32
        if c.allow_neg_eigval:
            beta = beta * 2
        gate = self.gate(x)  # (B, T, HV) or None
        q = q * c.head_k ** -0.5
        o, new["S"] = delta_rule.run(
            q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, HV, c.head_v).float().transpose(1, 2),
            beta.transpose(1, 2), None if gate is None else gate.transpose(1, 2), state["S"], exact,
            prefixes)  # (B, HV, T, dv)
        o = self.o_norm(o.transpose(1, 2), exact)  # (B, T, HV, dv) fp32
        if c.use_gate:
            g = numerics.activation(self.output_gate, g[0], torch.float32)  # (B, T, value_dim)
            o = o * g.view(B, T, HV, c.head_v)
        o = o.to(x.dtype).reshape(B, T, c.value_dim)  # (B, T, value_dim)
        return numerics.project(self.o_proj, o), new  # (B, T, C)

    def qk(self, q: torch.Tensor, k: torch.Tensor, exact: bool):
        return delta_rule.l2_normalize(q, exact), delta_rule.l2_normalize(k, exact)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gate(self, x: torch.Tensor) -> torch.Tensor | None:
        return None
