"""fla `gla` (Gated Linear Attention, Yang et al. 2023): S_t = diag(α_t)·S_{t-1} + k_t v_tᵀ with a gate per
key dimension from the token itself, log α_t = max(logsigmoid(W₂W₁x_t + b) / 16, clamp_min) (a rank-16
projection, fla's fixed normaliser 16), then fla's gated output (gated.py). Options: expand_k / expand_v,
num_kv_heads, feature_map, use_short_conv / conv_size, use_output_gate, clamp_min. fla 0.6.0's layer reads
neither `use_gk` nor `use_gv` (the key gate is always on, no value gate): linserve computes what fla does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import numerics
from .fla_base import FlaCausalLM, FlaConfig, read_shared
from .gated import GatedMixer, read_gated

DEFAULTS = dict(expand_k=0.5, expand_v=1.0, hidden_ratio=4, intermediate_size=None, num_hidden_layers=24,
                num_heads=4, num_kv_heads=None, feature_map=None, use_short_conv=False, conv_size=4,
                use_output_gate=True, clamp_min=None, hidden_act="swish", elementwise_affine=True, norm_eps=1e-6,
                attn=None, tie_word_embeddings=False, fuse_norm=True, attnres_block_size=None, hidden_size=2048,
                vocab_size=32000)
GATE_LOW_RANK, GATE_LOGIT_NORMALIZER = 16, 16  # fixed in fla's GatedLinearAttention


class GLAConfig(FlaConfig):
    @classmethod
    def from_raw(cls, raw: dict) -> GLAConfig:
        config = cls(**read_shared(raw, DEFAULTS))
        read_gated(config, raw, DEFAULTS)
        clamp = raw.get("clamp_min", DEFAULTS["clamp_min"])
        config.clamp_min = None if clamp is None else float(clamp)
        return config


class GatedLinearAttention(GatedMixer):
    def __init__(self, config: GLAConfig, layer_index: int) -> None:
        super().__init__(config)
        groups = config.num_heads // config.num_kv_heads
        self.gk_proj = nn.Sequential(nn.Linear(config.hidden_size, GATE_LOW_RANK, bias=False),
                                     nn.Linear(GATE_LOW_RANK, config.key_dim // groups, bias=True))

    def gate(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        logits = numerics.project(self.gk_proj[1], numerics.project(self.gk_proj[0], x))  # (B, T, kv·dk)
        log_alpha = numerics.activation("logsigmoid", logits, torch.float32) / GATE_LOGIT_NORMALIZER
        if c.clamp_min is not None:
            log_alpha = torch.clamp_min(log_alpha, c.clamp_min)
        per_head = log_alpha.view(B, T, c.num_kv_heads, c.head_k_dim)  # (B, T, kv, dk)
        if c.num_kv_heads != c.num_heads:
            per_head = per_head.repeat_interleave(c.num_heads // c.num_kv_heads, dim=2)  # (B, T, H, dk)
        return per_head.transpose(1, 2)  # (B, H, T, dk)


def build(raw: dict) -> FlaCausalLM:
    return FlaCausalLM(GLAConfig.from_raw(raw), GatedLinearAttention)
