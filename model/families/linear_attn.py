"""fla `linear_attn` (Katharopoulos et al. 2020, with fla's options): S_t = S_{t-1} + φ(k_t)v_tᵀ,
o_t = RMSNorm(scale·φ(q_t)ᵀS_t [/ scale·φ(q_t)ᵀz_t]) per head, then o_proj.

Feature maps: elu (ELU+1), relu, identity, hedgehog (softmax of ±2·Linear, 2·d_k features), t2r (ReLU of a
Linear), dpfp (ν = 4: 8·d_k features), elementwise_product (Linear ⊙ Linear); `tie_feature_map_qk` shares
the parametric map between q and k; `norm_q`/`norm_k` divide by the features' sum + 1e-4;
`norm_feature_map` divides by scale·φ(q)ᵀz + 1e-10 (z = Σφ(k): the state's second tensor). Scale: the
feature dimension^-½.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import numerics, recurrence
from ..feature_maps import elu1
from .fla_base import FlaCausalLM, FlaConfig, RMSNorm, UnsupportedCheckpoint, read_shared, repeat_groups

DEFAULTS = dict(expand_k=1.0, expand_v=1.0, hidden_ratio=4, intermediate_size=None, num_heads=4,
                num_kv_heads=None, feature_map="elementwise_product", tie_feature_map_qk=False, norm_q=False,
                norm_k=False, norm_feature_map=False, hidden_act="swish", elementwise_affine=True, norm_eps=1e-6,
                attn=None, tie_word_embeddings=False, attnres_block_size=None, num_hidden_layers=24,
                hidden_size=2048, vocab_size=32000)
FEATURE_MAPS = ("elu", "relu", "identity", "hedgehog", "t2r", "dpfp", "elementwise_product")
FEATURE_WIDTH = {"hedgehog": 2, "dpfp": 8}  # features per key dimension (others: 1)
DPFP_NU = 4


class LinearAttnConfig(FlaConfig):
    feature_map: str
    tie_feature_map_qk: bool
    norm_q: bool
    norm_k: bool
    norm_feature_map: bool

    @classmethod
    def from_raw(cls, raw: dict) -> LinearAttnConfig:
        get = lambda name: raw.get(name, DEFAULTS[name])  # noqa: E731
        if get("feature_map") not in FEATURE_MAPS:
            raise UnsupportedCheckpoint("feature_map", get("feature_map"), f"one of {', '.join(FEATURE_MAPS)}")
        config = cls(**read_shared(raw, DEFAULTS))
        config.feature_map = get("feature_map")
        config.tie_feature_map_qk = bool(get("tie_feature_map_qk"))
        config.norm_q, config.norm_k = bool(get("norm_q")), bool(get("norm_k"))
        config.norm_feature_map = bool(get("norm_feature_map"))
        features = config.head_k_dim * FEATURE_WIDTH.get(config.feature_map, 1)
        config.state_shapes = {"S": (config.num_heads, features, config.head_v_dim)}
        if config.norm_feature_map:
            config.state_shapes["z"] = (config.num_heads, features)
        return config


class HedgehogFeatureMap(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        y = 2 * numerics.project(self.layer, x).float()  # (…, d)
        logits = torch.cat([y, -y], dim=-1)  # (…, 2d)
        if not exact:
            return logits.softmax(-1)
        shifted = numerics.exp(logits - logits.amax(-1, keepdim=True))  # (…, 2d)
        return shifted / numerics.tree_sum(shifted, -1)[..., None]


class T2RFeatureMap(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        return torch.relu(numerics.project(self.layer, x)).float()


class HadamardFeatureMap(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer1 = nn.Linear(dim, dim)
        self.layer2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        return numerics.project(self.layer1, x).float() * numerics.project(self.layer2, x).float()


def dpfp(x: torch.Tensor) -> torch.Tensor:
    """DPFP with ν = 4: r = [relu(x), relu(-x)], features r_i · r_{i-j} for j = 1…4 (8·d)."""
    r = torch.cat([torch.relu(x), torch.relu(-x)], dim=-1)  # (…, 2d)
    rolled = torch.cat([r.roll(shifts=j, dims=-1) for j in range(1, DPFP_NU + 1)], dim=-1)  # (…, 8d)
    return torch.cat([r] * DPFP_NU, dim=-1) * rolled


def fixed_map(name: str, x: torch.Tensor, exact: bool) -> torch.Tensor:
    if name == "elu":
        if exact:
            return numerics.lookup(numerics.bf16_table("elu1", elu1, torch.float32, x.device), x)
        return elu1(x.float())
    x = x.float()
    if name == "relu":
        return torch.relu(x)
    if name == "dpfp":
        return dpfp(x)
    return x  # identity


PARAMETRIC = {"hedgehog": HedgehogFeatureMap, "t2r": T2RFeatureMap, "elementwise_product": HadamardFeatureMap}


class LinearAttention(nn.Module):
    @property
    def pooled_state(self) -> tuple[str, ...]:
        """S is read from the pool in place (pooled_state.py) unless z rides with it as a value column."""
        return () if self.config.norm_feature_map else ("S",)

    @property
    def folded_state(self) -> tuple[str, ...]:
        """The pooled S's commit is noted for the next read (pooled_state.py)."""
        return self.pooled_state

    def __init__(self, config: LinearAttnConfig, layer_index: int) -> None:
        super().__init__()
        self.config = config
        C, dk = config.hidden_size, config.head_k_dim
        groups = config.num_heads // config.num_kv_heads
        self.q_proj = nn.Linear(C, config.key_dim, bias=False)
        self.k_proj = nn.Linear(C, config.key_dim // groups, bias=False)
        self.v_proj = nn.Linear(C, config.value_dim // groups, bias=False)
        self.o_proj = nn.Linear(config.value_dim, C, bias=False)
        self.norm = RMSNorm(config.head_v_dim, config.norm_eps, config.elementwise_affine)
        if config.feature_map in PARAMETRIC:
            make = PARAMETRIC[config.feature_map]
            self.feature_map_q = make(dk)
            self.feature_map_k = self.feature_map_q if config.tie_feature_map_qk else make(dk)
        self.scale = (dk * FEATURE_WIDTH.get(config.feature_map, 1)) ** -0.5

    def features(self, x: torch.Tensor, which: str, exact: bool) -> torch.Tensor:
        if self.config.feature_map in PARAMETRIC:
            return getattr(self, f"feature_map_{which}")(x, exact)
        return fixed_map(self.config.feature_map, x, exact)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], exact: bool,
                prefixes: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        B, T, _ = x.shape
        q, k, v = numerics.project_all([self.q_proj, self.k_proj, self.v_proj], x)  # (B, T, ·) each
        q = q.view(B, T, c.num_heads, c.head_k_dim)  # (B, T, H, dk)
        k = repeat_groups(k, c.num_heads, c.head_k_dim)  # (B, T, H, dk)
        v = repeat_groups(v, c.num_heads, c.head_v_dim).float()  # (B, T, H, dv)
        q, k = self.features(q, "q", exact), self.features(k, "k", exact)  # (B, T, H, F) fp32
        if c.norm_q:
            q = q / (self.sum(q, exact) + 1e-4)
        if c.norm_k:
            k = k / (self.sum(k, exact) + 1e-4)
        q = (q * self.scale).transpose(1, 2)  # (B, H, T, F)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, F), (B, H, T, dv)
        S = state["S"]  # (B, H, F, dv)
        if c.norm_feature_map:  # z rides as a value column of ones: qᵀz is that column's output
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, dv+1)
            S = torch.cat([S, state["z"][..., None]], dim=-1)  # (B, H, F, dv+1)
        o, S = recurrence.run(q, k, v, None, S, exact, prefixes)  # (B, H, T, dv[+1])
        if c.norm_feature_map:
            o = o[..., :-1] / (o[..., -1:] + 1e-10)  # (B, H, T, dv)
            new = {"S": S[..., :-1].contiguous(), "z": S[..., -1].contiguous()}
        else:
            new = {"S": S}
        o = self.norm(o.transpose(1, 2), exact, x.dtype)  # (B, T, H, dv)
        return numerics.project(self.o_proj, o.reshape(B, T, c.value_dim)), new  # (B, T, C)

    @staticmethod
    def sum(x: torch.Tensor, exact: bool) -> torch.Tensor:
        return numerics.tree_sum(x, -1)[..., None] if exact else x.sum(-1, keepdim=True)


def build(raw: dict) -> FlaCausalLM:
    config = LinearAttnConfig.from_raw(raw)
    return FlaCausalLM(config, LinearAttention)
