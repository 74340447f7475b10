"""fla `delta_net` (DeltaNet: Schlag et al. 2021, parallelised by Yang et al. 2024): the delta rule
S_t = (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ per head (model/delta_rule.py), in delta.py's mixer.

Options: expand_k / expand_v, num_heads, use_beta (β = σ(b_proj x), else 1), allow_neg_eigval (β·2),
use_short_conv / conv_size (q and k convolved with SiLU only when qk_activation is silu; v always with SiLU),
qk_activation (silu, relu, elu — ELU+1 —, identity), qk_norm (l2 — x/√(Σx² + 1e-6) — or sum — x/max(Σ|x|,
1e-6)), use_gate (o_norm gated by SiLU(g_proj x)). fla 0.6.0's layer ignores `use_output_norm` (always
normalised) and takes no conv bias: linserve computes what fla does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import numerics
from .delta import DeltaMixer, set_delta_shapes
from .fla_base import FlaCausalLM, FlaConfig, UnsupportedCheckpoint, read_shared

DEFAULTS = dict(expand_k=1.0, expand_v=1.0, use_gate=False, use_short_conv=True, allow_neg_eigval=False,
                conv_size=4, use_beta=True, num_heads=16, qk_norm="l2", qk_activation="silu", hidden_ratio=4,
                intermediate_size=None, hidden_act="swish", num_hidden_layers=24, norm_eps=1e-6, attn=None,
                tie_word_embeddings=False, fuse_norm=True, attnres_block_size=None, hidden_size=2048,
                vocab_size=32000)
QK_ACTIVATIONS = {"silu": "silu", "relu": "relu", "elu": "elu1", "identity": None}
QK_NORMS = ("l2", "sum")


class DeltaNetConfig(FlaConfig):
    @classmethod
    def from_raw(cls, raw: dict) -> DeltaNetConfig:
        if raw.get("num_kv_heads") not in (None, raw.get("num_heads", DEFAULTS["num_heads"])):
            raise UnsupportedCheckpoint("num_kv_heads", raw["num_kv_heads"], "DeltaNet has no grouped heads: null")
        config = cls(**read_shared(raw, DEFAULTS))
        get = lambda name: raw.get(name, DEFAULTS[name])  # noqa: E731
        set_delta_shapes(config, raw, DEFAULTS, config.num_heads, config.head_k_dim, config.head_v_dim)
        config.use_beta = bool(get("use_beta"))
        config.qk_activation, config.qk_norm = get("qk_activation"), get("qk_norm")
        if config.qk_activation not in QK_ACTIVATIONS:
            raise UnsupportedCheckpoint("qk_activation", config.qk_activation, f"one of {', '.join(QK_ACTIVATIONS)}")
        if config.qk_norm not in QK_NORMS:
            raise UnsupportedCheckpoint("qk_norm", config.qk_norm, f"one of {', '.join(QK_NORMS)}")
        return config


def sum_normalize(x: torch.Tensor, exact: bool, eps: float = 1e-6) -> torch.Tensor:
    """x / max(Σ|x|, eps) over the last dimension (fla's sum_norm, F.normalize with p = 1), fp32."""
    x = x.float()
    total = numerics.tree_sum(x.abs(), -1) if exact else x.abs().sum(-1)  # (…)
    return x / torch.clamp_min(total, eps)[..., None]


class DeltaNet(DeltaMixer):
    def __init__(self, config: DeltaNetConfig, layer_index: int) -> None:
        super().__init__(config, "silu" if config.qk_activation == "silu" else None)
        if config.use_beta:
            self.b_proj = nn.Linear(config.hidden_size, config.num_heads, bias=False)

    def qk(self, q: torch.Tensor, k: torch.Tensor, exact: bool):
        act = QK_ACTIVATIONS[self.config.qk_activation]
        if act is not None and act != "silu":  # silu was the convolution's (or the projection's)
            q, k = numerics.activation(act, q), numerics.activation(act, k)
        if self.config.qk_norm == "sum":
            return sum_normalize(q, exact), sum_normalize(k, exact)
        return super().qk(q, k, exact)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        if not self.config.use_beta:
            return torch.ones(*x.shape[:2], self.config.num_heads, device=x.device)  # (B, T, H)
        return numerics.activation("sigmoid", numerics.project(self.b_proj, x), torch.float32)  # (B, T, H)


def build(raw: dict) -> FlaCausalLM:
    return FlaCausalLM(DeltaNetConfig.from_raw(raw), DeltaNet)
