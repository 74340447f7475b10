"""fla `mamba2` (Mamba-2's state-space duality, Dao & Gu 2024), also the layout transformers' Mamba2 saves: per
layer RMSNorm → mixer → residual, no MLP. The mixer:

    z, xBC, dt = in_proj(x)                                  (gate (I), conv input (I + 2·G·N), one dt per head)
    x, B, C    = act(conv1d(xBC))                            a depthwise causal convolution of W taps
    dt         = clamp(softplus(dt + dt_bias), dt_limit)     (H,) per token
    S_t        = exp(dt·A)·S_{t-1} + B_t (dt·x_t)ᵀ           A = -exp(A_log) per head; S (N, P) per head
    y_t        = S_tᵀ C_t + D·x_t
    out        = out_proj(GatedRMSNorm(y, z))                 (or y·act(z) without rmsnorm)

with H = I / P heads of P = head_dim channels, and B, C shared by the H/G heads of each of G groups (head h reads
group h // (H/G), as mamba_ssm's kernels and transformers do). The recurrence is fla's gated linear form with one
decay per head and token (q = C, k = B, v = dt·x, unscaled): recurrence.py computes it in both forms. The state
per layer: the convolution's last W - 1 inputs (W - 1, I + 2·G·N) and S (H, N, P), fp32.

Options: head_dim, num_heads, state_size, expand, n_groups, conv_kernel, use_bias, use_conv_bias, hidden_act,
D_has_hdim, rmsnorm, norm_before_gate, dt_limit, residual_in_fp32, tie_word_embeddings — under fla's names or
transformers' (layer_norm_epsilon, rms_norm, time_step_limit); a config written by transformers takes its
defaults for an absent field (n_groups 8), one written by fla fla's (n_groups 1).

fla 0.6.0's own CPU prefill (its torch path without mamba_ssm) tiles B and C over the heads (head h reads group
h mod G) while its decoding step groups them (h // (H/G)): with n_groups > 1 its prompt and its decoding disagree.
linserve computes mamba_ssm's (the decoding step's) for both; tests compare n_groups > 1 against transformers'.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import numerics, recurrence
from .fla_base import FlaCausalLM, FlaConfig, RMSNorm, ShortConvolution, UnsupportedCheckpoint

FLA_DEFAULTS = dict(head_dim=64, hidden_size=2048, state_size=128, num_hidden_layers=48,
                    norm_eps=1e-5, expand=2, conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
                    hidden_act="silu", D_has_hdim=False, rmsnorm=True, norm_before_gate=False,
                    dt_limit=(0.0, math.inf), residual_in_fp32=True, tie_word_embeddings=False, vocab_size=32000)
# transformers' Mamba2Config: its names for three fields, and its defaults where they differ from fla's
TRANSFORMERS_NAMES = {"norm_eps": "layer_norm_epsilon", "rmsnorm": "rms_norm", "dt_limit": "time_step_limit"}
TRANSFORMERS_DEFAULTS = {**FLA_DEFAULTS, "hidden_size": 4096, "num_hidden_layers": 64,
                         "n_groups": 8, "vocab_size": 32768}
ACTIVATIONS = ("silu", "swish", "sigmoid", "relu", "gelu")  # fla's ACT2FN names linserve computes exactly


def finite_or_infinite(value) -> float:
    """A float as transformers 5 writes a non-finite one ({"__float__": "Infinity"}) or as JSON has it."""
    return float(value["__float__"] if isinstance(value, dict) else value)


class Mamba2Config(FlaConfig):
    @classmethod
    def from_raw(cls, raw: dict) -> Mamba2Config:
        transformers_layout = any(name in raw for name in TRANSFORMERS_NAMES.values())
        defaults = TRANSFORMERS_DEFAULTS if transformers_layout else FLA_DEFAULTS

        def get(name: str):
            alias = TRANSFORMERS_NAMES.get(name)
            if alias is not None and alias in raw:
                return raw[alias]
            return raw.get(name, defaults[name])

        hidden, head_dim, expand = int(get("hidden_size")), int(get("head_dim")), get("expand")
        inner = expand * hidden
        if not math.isclose(inner, round(inner)) or round(inner) % head_dim:
            raise UnsupportedCheckpoint("head_dim", head_dim, f"a divisor of expand × hidden_size ({inner})")
        inner = round(inner)
        heads = inner // head_dim
        if raw.get("num_heads") not in (None, 0, heads):
            raise UnsupportedCheckpoint("num_heads", raw["num_heads"], f"expand × hidden_size / head_dim = {heads}")
        groups = int(get("n_groups"))
        if groups < 1 or heads % groups:
            raise UnsupportedCheckpoint("n_groups", groups, f"a divisor of the number of heads ({heads})")
        act = get("hidden_act")
        if act not in ACTIVATIONS:
            raise UnsupportedCheckpoint("hidden_act", act, f"one of {', '.join(ACTIVATIONS)}")
        if transformers_layout and act == "gelu":  # transformers' ACT2FN gelu is erf's, fla's (served) tanh's
            raise UnsupportedCheckpoint("hidden_act", act, "with transformers' layout: silu, swish, sigmoid or relu")
        kernel = int(get("conv_kernel"))
        if kernel < 2:
            raise UnsupportedCheckpoint("conv_kernel", kernel, "at least 2")
        limit = get("dt_limit")
        low, high = (finite_or_infinite(v) for v in limit)
        if not low <= high:
            raise UnsupportedCheckpoint("dt_limit", limit, "[low, high] with low ≤ high")
        state_size = int(get("state_size"))
        config = cls(raw=raw, model_type="mamba2", hidden_size=hidden, n_layers=int(get("num_hidden_layers")),
                     vocab_size=int(get("vocab_size")), num_heads=heads, num_kv_heads=heads,
                     key_dim=heads * state_size, value_dim=inner, norm_eps=float(get("norm_eps")),
                     elementwise_affine=True, intermediate_size=inner,
                     tie_word_embeddings=bool(get("tie_word_embeddings")), hidden_act=act)
        config.head_dim, config.state_size, config.n_groups, config.conv_kernel = head_dim, state_size, groups, kernel
        config.use_bias, config.use_conv_bias = bool(get("use_bias")), bool(get("use_conv_bias"))
        config.D_has_hdim, config.rmsnorm = bool(get("D_has_hdim")), bool(get("rmsnorm"))
        config.norm_before_gate = bool(get("norm_before_gate"))
        config.dt_limit = (low, high)
        config.conv_dim = inner + 2 * groups * state_size
        config.state_shapes = {"conv": (kernel - 1, config.conv_dim), "S": (heads, state_size, head_dim)}
        return config


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, config: Mamba2Config,
                   exact: bool) -> torch.Tensor:
    """fla's RMSNormGated (norm_before_gate False: the norm of y·silu(z); True: the norm of y, then ·silu(z)),
    over groups of I / n_groups channels. y (B, T, I) fp32, gate (B, T, I) → (B, T, I) fp32."""
    B, T, inner = y.shape
    silu = numerics.activation("silu", gate if exact else gate.float(), torch.float32)  # (B, T, I)
    h = y if config.norm_before_gate else y * silu
    grouped = h.view(B, T, config.n_groups, inner // config.n_groups)  # (B, T, G, I/G)
    h = numerics.rms_norm(grouped, None, config.norm_eps, exact, torch.float32).view(B, T, inner) * weight.float()
    return h * silu if config.norm_before_gate else h  # (B, T, I)


class GatedNorm(nn.Module):
    """Parameter `weight` (I,), as fla's and transformers' gated norm name it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class Mamba2Mixer(nn.Module):
    pooled_state = ("S",)  # decoded from the pool in place (pooled_state.py)
    folded_state = ("S",)  # its commit noted for the next read (pooled_state.py)

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.config = config
        c = config
        self.in_proj = nn.Linear(c.hidden_size, c.intermediate_size + c.conv_dim + c.num_heads, bias=c.use_bias)
        self.conv1d = ShortConvolution(c.conv_dim, c.conv_kernel, c.use_conv_bias,
                                       activation="silu" if c.hidden_act == "swish" else c.hidden_act)
        self.dt_bias = nn.Parameter(torch.zeros(c.num_heads))
        self.A_log = nn.Parameter(torch.zeros(c.num_heads))
        self.D = nn.Parameter(torch.ones(c.intermediate_size if c.D_has_hdim else c.num_heads))
        if c.rmsnorm:
            self.norm = GatedNorm(c.intermediate_size)
        self.out_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.use_bias)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor], exact: bool,
                prefixes: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        B, T, _ = x.shape
        H, P, N, G = c.num_heads, c.head_dim, c.state_size, c.n_groups
        new: dict[str, torch.Tensor] = {}
        projected = numerics.project(self.in_proj, x)  # (B, T, I + conv_dim + H)
        gate, xBC, dt = projected.split([c.intermediate_size, c.conv_dim, H], dim=-1)
        xBC, new["conv"] = self.conv1d(xBC, state["conv"], prefixes)  # (B, T, conv_dim)
        xs, Bg, Cg = xBC.split([c.intermediate_size, G * N, G * N], dim=-1)
        dt = numerics.softplus(dt.float() + self.dt_bias.float())  # (B, T, H) fp32
        dt = torch.clamp(dt, c.dt_limit[0], c.dt_limit[1])
        A = -numerics.exp(self.A_log.float())  # (H,)
        log_decay = (dt * A).transpose(1, 2)[..., None]  # (B, H, T, 1)
        xh = xs.float().view(B, T, H, P)  # (B, T, H, P)
        v = (xh * dt[..., None]).transpose(1, 2)  # (B, H, T, P)
        k = Bg.float().view(B, T, G, N).repeat_interleave(H // G, dim=2).transpose(1, 2)  # (B, H, T, N)
        q = Cg.float().view(B, T, G, N).repeat_interleave(H // G, dim=2).transpose(1, 2)  # (B, H, T, N)
        o, new["S"] = recurrence.run(q, k, v, log_decay, state["S"], exact, prefixes)  # (B, H, T, P)
        D = self.D.float().view(H, P) if c.D_has_hdim else self.D.float()[:, None]  # (H, P) or (H, 1)
        y = (o.transpose(1, 2) + xh * D).reshape(B, T, c.intermediate_size)  # (B, T, I) fp32
        if c.rmsnorm:
            y = gated_rms_norm(y, gate, self.norm.weight, c, exact)
        else:
            y = y * numerics.activation(self.conv1d.activation, gate if exact else gate.float(), torch.float32)
        return numerics.project(self.out_proj, y.to(x.dtype)), new  # (B, T, C)


class Mamba2Block(nn.Module):
    """norm → mixer → residual (fla's Mamba2Block; residual_in_fp32 rounds the sum once either way)."""

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mixer = Mamba2Mixer(config)

    def forward(self, x: torch.Tensor, state: dict[str, torch.Tensor],
                prefixes: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        exact = numerics.exact_inference(x)
        y, state = self.mixer(self.norm(x, exact), state, exact, prefixes)  # (B, T, C)
        return x + y, state


class Mamba2Backbone(nn.Module):
    """`backbone.embeddings`, `backbone.layers.{i}`, `backbone.norm_f` — fla's and transformers' names."""

    def __init__(self, config: Mamba2Config) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(config) for _ in range(config.n_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.norm_eps)

    def final_norm(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        return self.norm_f(x, exact)


def build(raw: dict) -> FlaCausalLM:
    config = Mamba2Config.from_raw(raw)
    return FlaCausalLM(config, backbone=Mamba2Backbone(config), backbone_name="backbone")
