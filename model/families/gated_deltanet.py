"""fla `gated_deltanet` (Gated DeltaNet, Yang et al. 2025 — the linear layer of Qwen3-Next and Qwen3.5): the
gated delta rule S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ per value head (model/delta_rule.py), in
delta.py's mixer, with

    log α_t = −exp(A_log) · softplus(a_proj x_t + dt_bias)        β_t = σ(b_proj x_t)   (·2: allow_neg_eigval)

q and k (SiLU, through the short convolution when there is one) L2-normalised. Options: head_dim, num_heads,
num_v_heads (grouped values: a multiple of num_heads), expand_v, use_gate with output_gate_activation (swish,
silu, sigmoid), use_short_conv / conv_size, allow_neg_eigval. fla stores this state value-first (HV, d_v, d_k);
linserve keeps (HV, d_k, d_v) like every other family.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import numerics
from .delta import OUTPUT_GATES, DeltaMixer, set_delta_shapes
from .fla_base import FlaCausalLM, FlaConfig, UnsupportedCheckpoint, read_shared

DEFAULTS = dict(expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False, conv_size=4,
                head_dim=256, num_heads=6, num_v_heads=None, hidden_ratio=4, intermediate_size=None,
                hidden_act="swish", num_hidden_layers=21, norm_eps=1e-6, attn=None, tie_word_embeddings=False,
                fuse_norm=True, attnres_block_size=None, output_gate_activation="swish", hidden_size=2048,
                vocab_size=32000)


class GatedDeltaNetConfig(FlaConfig):
    @classmethod
    def from_raw(cls, raw: dict) -> GatedDeltaNetConfig:
        get = lambda name: raw.get(name, DEFAULTS[name])  # noqa: E731
        heads, head_k = int(get("num_heads")), int(get("head_dim"))
        value_heads = int(get("num_v_heads") or heads)
        if value_heads < heads or value_heads % heads:
            raise UnsupportedCheckpoint("num_v_heads", get("num_v_heads"),
                                        f"null or a multiple of num_heads ({heads}): each q/k head serves whole "
                                        "value heads")
        expand_v = float(get("expand_v"))
        head_v = head_k * expand_v
        if not math.isclose(head_v, round(head_v)):
            raise UnsupportedCheckpoint("expand_v", expand_v, "head_dim × expand_v must be an integer")
        head_v = round(head_v)
        if raw.get("num_kv_heads") not in (None, heads):
            raise UnsupportedCheckpoint("num_kv_heads", raw["num_kv_heads"], "Gated DeltaNet groups values by "
                                        "num_v_heads; num_kv_heads must be null")
        config = cls(**read_shared(raw, DEFAULTS, dims=(heads * head_k, value_heads * head_v)))
        set_delta_shapes(config, raw, DEFAULTS, value_heads, head_k, head_v)
        gate = get("output_gate_activation")
        if gate not in OUTPUT_GATES:
            raise UnsupportedCheckpoint("output_gate_activation", gate, f"one of {', '.join(OUTPUT_GATES)}")
        config.output_gate_activation = gate
        return config


class GatedDeltaNet(DeltaMixer):
    def __init__(self, config: GatedDeltaNetConfig, layer_index: int) -> None:
        super().__init__(config)
        HV = config.value_heads
        self.output_gate = OUTPUT_GATES[config.output_gate_activation]
        self.a_proj = nn.Linear(config.hidden_size, HV, bias=False)
        self.b_proj = nn.Linear(config.hidden_size, HV, bias=False)
        self.A_log = nn.Parameter(torch.zeros(HV))
        self.dt_bias = nn.Parameter(torch.zeros(HV))

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        return numerics.activation("sigmoid", numerics.project(self.b_proj, x), torch.float32)  # (B, T, HV)

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        """log α = −exp(A_log)·softplus(a + dt_bias), in float64 (the same bits eager and compiled)."""
        a = numerics.project(self.a_proj, x).double() + self.dt_bias.double()  # (B, T, HV)
        return (-torch.exp(self.A_log.double()) * F.softplus(a, threshold=20.0)).float()  # (B, T, HV)


def build(raw: dict) -> FlaCausalLM:
    return FlaCausalLM(GatedDeltaNetConfig.from_raw(raw), GatedDeltaNet)
