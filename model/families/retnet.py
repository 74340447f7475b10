"""fla `retnet` (RetNet's multi-scale retention, Sun et al. 2023): S_t = γ_h·S_{t-1} + k_t v_tᵀ with a fixed
decay per head, γ_h = 1 - 2^(-5-h), queries and keys rotated by their absolute position (RoPE over the
whole key head, halves rotated, base 10,000), then fla's gated output (gated.py). The state adds the
position: one int64 per layer (as fla's cache counts tokens per layer). Options: expand_k / expand_v,
num_kv_heads, feature_map, use_output_gate. fla 0.6.0's RetNet block does not pass `use_short_conv` to its
layer: no convolution, in fla and here.
"""

from __future__ import annotations

import torch

from .fla_base import FlaCausalLM, FlaConfig, read_shared, rope_cos_sin, rotate
from .gated import GatedMixer, read_gated

DEFAULTS = dict(expand_k=1.0, expand_v=2.0, hidden_ratio=2, intermediate_size=None, num_hidden_layers=24,
                num_heads=8, num_kv_heads=None, feature_map=None, use_short_conv=False, conv_size=4,
                use_output_gate=True, hidden_act="swish", elementwise_affine=True, norm_eps=1e-6, attn=None,
                tie_word_embeddings=False, fuse_norm=True, attnres_block_size=None, hidden_size=2048,
                vocab_size=32000)
ROPE_BASE = 10000.0


class RetNetConfig(FlaConfig):
    @classmethod
    def from_raw(cls, raw: dict) -> RetNetConfig:
        config = cls(**read_shared(raw, DEFAULTS))
        read_gated(config, {**raw, "use_short_conv": False}, DEFAULTS)
        config.state_shapes["position"] = ()
        return config


class MultiScaleRetention(GatedMixer):
    rotate_before_repeat = True

    def __init__(self, config: RetNetConfig, layer_index: int) -> None:
        super().__init__(config)

    def gate(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        heads = torch.arange(self.config.num_heads, dtype=torch.float32, device=x.device)  # (H,)
        return torch.log(1 - 2.0 ** (-5.0 - heads))  # (H,) log γ_h (fp32, as fla computes it)

    def position(self, q, k, state, prefixes, new):
        """RoPE at each token's absolute position (the state's count + t). q (B, T, H, dk), k (B, T, kv, dk)."""
        B, T, _, dk = q.shape
        start = state["position"]  # (B,) int64
        steps = torch.arange(T, device=q.device)  # (T,)
        cos, sin = rope_cos_sin(start[:, None] + steps, dk, ROPE_BASE, q.dtype)  # (B, T, 1, dk/2) each
        new["position"] = start[:, None] + steps + 1 if prefixes else start + T  # (B, T) or (B,)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def build(raw: dict) -> FlaCausalLM:
    return FlaCausalLM(RetNetConfig.from_raw(raw), MultiScaleRetention)
