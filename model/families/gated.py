"""The mixer layout GLA and RetNet share in fla: q/k/v projections (optionally each through a short
convolution), grouped key/value heads, the recurrence, then a per-head RMSNorm and an output gate:

    o = o_proj(RMSNorm(o) · gate_fn(g_proj(x)))      (use_output_gate)      o = o_proj(RMSNorm(o))  (else)

The norm's parameter is `g_norm_swish_gate` where fla fuses it with a swish gate (fuse_norm, gate 'swish',
an output gate), else `g_norm` — the same function, named as fla names it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import numerics, recurrence
from .fla_base import FlaConfig, RMSNorm, ShortConvolution, UnsupportedCheckpoint, project_qkv, repeat_groups

ACTIVATIONS = ("swish", "silu", "relu", "sigmoid", "logsigmoid", "sqrelu", "gelu")  # fla's ACT2FN, served


def read_gated(config: FlaConfig, raw: dict, defaults: dict) -> None:
    """The mixer options GLA and RetNet share, onto `config`."""
    get = lambda name: raw.get(name, defaults.get(name))  # noqa: E731
    config.feature_map = get("feature_map")
    if config.feature_map is not None and config.feature_map not in ACTIVATIONS:
        raise UnsupportedCheckpoint("feature_map", config.feature_map, f"null or one of {', '.join(ACTIVATIONS)}")
    config.use_output_gate = bool(get("use_output_gate"))
    config.gate_fn = get("hidden_act")
    if config.use_output_gate and config.gate_fn not in ACTIVATIONS:  # fla's layer takes ACT2FN[hidden_act]
        raise UnsupportedCheckpoint("hidden_act", config.gate_fn,
                                    f"with use_output_gate, one of {', '.join(ACTIVATIONS)} (fla's output gate "
                                    "takes hidden_act; fla has no powlu gate)")
    config.fuse_norm = bool(get("fuse_norm"))
    config.use_short_conv = bool(get("use_short_conv"))
    config.conv_size = int(get("conv_size"))
    if config.use_short_conv and config.conv_size < 2:
        raise UnsupportedCheckpoint("conv_size", config.conv_size, "at least 2 with use_short_conv")
    groups = config.num_heads // config.num_kv_heads
    config.state_shapes = {"S": (config.num_heads, config.head_k_dim, config.head_v_dim)}
    if config.use_short_conv:
        window = config.conv_size - 1
        config.state_shapes.update(conv_q=(window, config.key_dim), conv_k=(window, config.key_dim // groups),
                                   conv_v=(window, config.value_dim // groups))


class GatedMixer(nn.Module):
    """Subclasses give `gate(x, state, exact)` (the log decay: None, (H,) or (B, H, T, dk)) and may
    `position(q, k, state, prefixes)` (RetNet's rotary)."""

    rotate_before_repeat = False  # RetNet rotates k per kv head, then repeats it
    pooled_state = ("S",)  # decoded from the pool in place (pooled_state.py)
    folded_state = ("S",)  # its commit noted for the next read (pooled_state.py)

    def __init__(self, config: FlaConfig, conv_bias: bool = False) -> None:
        super().__init__()
        self.config = config
        C = config.hidden_size
        groups = config.num_heads // config.num_kv_heads
        self.q_proj = nn.Linear(C, config.key_dim, bias=False)
        self.k_proj = nn.Linear(C, config.key_dim // groups, bias=False)
        self.v_proj = nn.Linear(C, config.value_dim // groups, bias=False)
        if config.use_output_gate:
            self.g_proj = nn.Linear(C, config.value_dim, bias=False)
        if config.use_short_conv:
            self.q_conv1d = ShortConvolution(config.key_dim, config.conv_size, conv_bias)
            self.k_conv1d = ShortConvolution(config.key_dim // groups, config.conv_size, conv_bias)
            self.v_conv1d = ShortConvolution(config.value_dim // groups, config.conv_size, conv_bias)
        self.o_proj = nn.Linear(config.value_dim, C, bias=False)
        fused = config.gate_fn == "swish" and config.fuse_norm and config.use_output_gate
        self.norm_name = "g_norm_swish_gate" if fused else "g_norm"
        self.add_module(self.norm_name, RMSNorm(config.head_v_dim, config.norm_eps, config.elementwise_affine))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.config.feature_map is None else numerics.activation(self.config.feature_map, x)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], exact: bool,
                prefixes: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        B, T, _ = x.shape
        new: dict[str, torch.Tensor] = {}
        q, k, v, *g = project_qkv(self, x, state, prefixes, new,  # (B, T, ·) each; g: [the output gate's]
                                  (self.g_proj,) if c.use_output_gate else ())
        q = self.features(q.view(B, T, c.num_heads, c.head_k_dim))  # (B, T, H, dk)
        if self.rotate_before_repeat:
            k = self.features(k.view(B, T, c.num_kv_heads, c.head_k_dim))  # (B, T, kv, dk)
            q, k = self.position(q, k, state, prefixes, new)
            k = k if c.num_kv_heads == c.num_heads else k.repeat_interleave(c.num_heads // c.num_kv_heads, dim=2)
        else:
            k = self.features(repeat_groups(k, c.num_heads, c.head_k_dim))  # (B, T, H, dk)
        v = repeat_groups(v, c.num_heads, c.head_v_dim)  # (B, T, H, dv)
        gate = self.gate(x, exact)  # None, (H,) or (B, H, T, dk)
        q = q.float().transpose(1, 2) * c.head_k_dim ** -0.5  # (B, H, T, dk)
        o, new["S"] = recurrence.run(q, k.float().transpose(1, 2), v.float().transpose(1, 2), gate, state["S"],
                                     exact, prefixes)  # (B, H, T, dv)
        o = getattr(self, self.norm_name)(o.transpose(1, 2), exact)  # (B, T, H, dv) fp32
        if c.use_output_gate:
            g = numerics.activation("silu" if c.gate_fn == "swish" else c.gate_fn, g[0], torch.float32)
            o = o * g.view(B, T, c.num_heads, c.head_v_dim)
        o = o.to(x.dtype).reshape(B, T, c.value_dim)  # (B, T, value_dim)
        return numerics.project(self.o_proj, o), new  # (B, T, C)

    def gate(self, x: torch.Tensor, exact: bool):
        raise NotImplementedError

    def position(self, q, k, state, prefixes, new):
        return q, k
