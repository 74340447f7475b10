"""fla `rwkv7` (RWKV-7 "Goose", Peng et al. 2025). Per layer: [pre_norm, layer 0] → attn_norm → time mix → residual
→ ffn_norm → channel mix → residual; LayerNorms with bias. The time mix of token t, with x' the previous token's
input (the layer's shift state) and δ = x' − x:

    x_r, x_w, x_k, x_v, x_a, x_g = x + δ·μ_*                       (token shift: six learned mixes)
    r = W_r x_r     k = W_k x_k     v = W_v x_v
    w = −e^{−½}·σ(LoRA_w(x_w))                                    log decay per key dimension, tanh LoRA
    v = lerp(v, v_first, σ(LoRA_v(x_v)))                          layers after the first (v-first residual)
    a = σ(LoRA_a(x_a))      g = LoRA_g(x_g)                        (sigmoid inside LoRA_g)
    κ̂ = l2norm(k ⊙ k_k) per head      k = k ⊙ (1 + (a − 1)·k_a)
    S_t = diag(e^w) S + (κ̂ ⊙ a)(−κ̂ᵀ S) + k vᵀ,  o = Sᵀ r           (generalized_delta.py)
    o = (GroupNorm_heads(o) + (Σ r ⊙ k ⊙ r_k)·v) ⊙ g;  out = W_o o

and the channel mix: W_value · act(W_key (x + δ'·μ_k)) with its own shift state (act `hidden_act`, sqrelu).
v_first is layer 0's v of the same token, carried through the layers of one forward (not a state).

State per layer (fp32): the two shift inputs (hidden,) each and S (H, head_dim, head_v_dim). Options: head_dim /
num_heads, value_dim (one for every layer), the four LoRA ranks (fla's formulas when null), hidden_ratio /
intermediate_size, hidden_act, norm_first, norm_bias, norm_eps, fuse_norm (fla's l2norm vs F.normalize for κ̂),
tie_word_embeddings. fla's softmax layers inside RWKV-7 (`attn`) are refused.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import generalized_delta, numerics
from ..delta_rule import l2_normalize
from .fla_base import FlaCausalLM, FlaConfig, UnsupportedCheckpoint

DEFAULTS = dict(hidden_size=2048, hidden_ratio=4, intermediate_size=None, num_hidden_layers=24, head_dim=64,
                num_heads=None, decay_low_rank_dim=64, gate_low_rank_dim=128, a_low_rank_dim=64, v_low_rank_dim=16,
                hidden_act="sqrelu", norm_first=True, norm_bias=True, norm_eps=1e-5, attn=None,
                tie_word_embeddings=False, fuse_norm=True, vocab_size=32000, value_dim=None)
DECAY_BOUND = -0.6065306597126334  # −e^{−½}: fla's w = DECAY_BOUND·σ(·), so e^w ∈ (0.545, 1)
FFN_ACTIVATIONS = ("sqrelu", "relu", "silu", "swish", "gelu", "sigmoid")


def lora_rank(given, factor: float, hidden: int, head_dim: int, scale_by_head: bool) -> int:
    """fla's LoRA rank when the config leaves it null: max(32, round(factor·√hidden·(head_dim/64 where scaled) / 32)
    · 32)."""
    if given is not None:
        return int(given)
    scaled = factor * hidden ** 0.5 * (head_dim / 64 if scale_by_head else 1)
    return max(32, int(round(scaled / 32) * 32))


class RWKV7Config(FlaConfig):
    @classmethod
    def from_raw(cls, raw: dict) -> RWKV7Config:
        get = lambda name: raw.get(name, DEFAULTS[name])  # noqa: E731
        if get("attn") is not None:
            raise UnsupportedCheckpoint("attn", get("attn"), "RWKV-7 with softmax layers is not served; null is")
        hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
        head_dim, heads = get("head_dim"), get("num_heads")
        if head_dim is None and heads is None:
            raise UnsupportedCheckpoint("head_dim", None, "head_dim or num_heads")
        head_dim = int(head_dim) if head_dim is not None else hidden // int(heads)
        if hidden % head_dim:
            raise UnsupportedCheckpoint("head_dim", head_dim, f"a divisor of hidden_size ({hidden})")
        heads = hidden // head_dim
        values = get("value_dim")
        values = [hidden] * layers if values is None else [int(values)] * layers if isinstance(values, int) \
            else [int(v) for v in values]
        if len(values) != layers or any(v < hidden or v % hidden or v != values[0] for v in values):
            raise UnsupportedCheckpoint("value_dim", get("value_dim"),
                                        f"one multiple of hidden_size ({hidden}) for every layer (layer 0's values "
                                        "are mixed into every layer's: v_first)")
        act = get("hidden_act")
        if act not in FFN_ACTIVATIONS:
            raise UnsupportedCheckpoint("hidden_act", act, f"one of {', '.join(FFN_ACTIVATIONS)}")
        intermediate = get("intermediate_size")
        if intermediate is None:
            intermediate = int(hidden * (get("hidden_ratio") or 4))
            intermediate = 32 * ((intermediate + 31) // 32)
        config = cls(raw=raw, model_type="rwkv7", hidden_size=hidden, n_layers=layers,
                     vocab_size=int(get("vocab_size")),
                     num_heads=heads, num_kv_heads=heads, key_dim=hidden, value_dim=values[0],
                     norm_eps=float(get("norm_eps")), elementwise_affine=True, intermediate_size=int(intermediate),
                     tie_word_embeddings=bool(get("tie_word_embeddings")), hidden_act=act)
        config.head_dim = head_dim
        config.ranks = dict(
            w=lora_rank(get("decay_low_rank_dim"), 2.5, hidden, head_dim, True),
            g=lora_rank(get("gate_low_rank_dim"), 5.0, hidden, head_dim, False),
            a=lora_rank(get("a_low_rank_dim"), 2.5, hidden, head_dim, True),
            v=lora_rank(get("v_low_rank_dim"), 1.7, hidden, head_dim, True))
        config.norm_first, config.norm_bias = bool(get("norm_first")), bool(get("norm_bias"))
        config.fuse_norm = bool(get("fuse_norm"))
        config.state_shapes = {"shift_attn": (hidden,), "S": (heads, head_dim, values[0] // heads),
                               "shift_ffn": (hidden,)}
        return config


def lora(x: torch.Tensor, module: nn.Sequential, inner: str | None, exact: bool) -> torch.Tensor:
    """fla's LoRA: Linear → inner activation (tanh, sigmoid or none) → Linear (with its bias)."""
    h = numerics.project(module[0], x)  # (B, T, rank)
    if inner is not None:
        h = numerics.activation(inner, h)
    return numerics.project(module[2], h)


def make_lora(hidden: int, out: int, rank: int, bias: bool = True) -> nn.Module:
    holder = nn.Module()
    holder.lora = nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Identity(), nn.Linear(rank, out, bias=bias))
    return holder


def shifted(x: torch.Tensor, last: torch.Tensor, prefixes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """δ = x_{t-1} − x_t with x_{-1} the state's last input (B, C) fp32; the new state: the last input, or with
    `prefixes` every token's (B, T, C)."""
    previous = torch.cat([last.to(x.dtype)[:, None], x[:, :-1]], dim=1)  # (B, T, C)
    return previous - x, (x.float() if prefixes else x[:, -1].float())


def mix(x: torch.Tensor, delta: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """x + δ·μ in fp32 (one product, one sum), rounded once to x's dtype."""
    return (x.float() + delta.float() * mu.float().reshape(-1)).to(x.dtype)


class TimeMix(nn.Module):
    def __init__(self, config: RWKV7Config, layer_index: int) -> None:
        super().__init__()
        c, C = config, config.hidden_size
        self.config, self.layer_index = config, layer_index
        self.value_dim = c.value_dim
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, C)))
        self.k_k, self.k_a = nn.Parameter(torch.zeros(C)), nn.Parameter(torch.zeros(C))
        self.r_k = nn.Parameter(torch.zeros(c.num_heads, c.head_dim))
        self.r_proj, self.k_proj = nn.Linear(C, C, bias=False), nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, C, bias=False)
        self.w_lora = make_lora(C, C, c.ranks["w"])
        if layer_index != 0:
            self.v_lora = make_lora(C, self.value_dim, c.ranks["v"])
        self.a_lora = make_lora(C, C, c.ranks["a"])
        self.g_lora = make_lora(C, self.value_dim, c.ranks["g"], bias=False)
        self.g_norm = nn.GroupNorm(c.num_heads, self.value_dim, eps=c.head_dim * c.norm_eps)

    def forward(self, x: torch.Tensor, state: dict, exact: bool, prefixes: bool,
                v_first: torch.Tensor | None) -> tuple[torch.Tensor, dict, torch.Tensor]:
        c = self.config
        B, T, C = x.shape
        H, dk, dv = c.num_heads, c.head_dim, self.value_dim // c.num_heads
        new: dict[str, torch.Tensor] = {}
        delta, new["shift_attn"] = shifted(x, state["shift_attn"], prefixes)  # (B, T, C)
        xr, xw, xk, xv, xa, xg = (mix(x, delta, getattr(self, n)) for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        r = numerics.project(self.r_proj, xr).float()  # (B, T, C)
        w = DECAY_BOUND * numerics.activation("sigmoid", lora(xw, self.w_lora.lora, "tanh", exact), torch.float32)
        k = numerics.project(self.k_proj, xk).float()  # (B, T, C)
        v = numerics.project(self.v_proj, xv).float()  # (B, T, value_dim)
        if self.layer_index == 0:
            v_first = v
        else:
            s = numerics.activation("sigmoid", lora(xv, self.v_lora.lora, None, exact), torch.float32)
            v = v + s * (v_first - v)  # (B, T, value_dim): lerp towards layer 0's v
        a = numerics.activation("sigmoid", lora(xa, self.a_lora.lora, None, exact), torch.float32)  # (B, T, C)
        g = lora(xg, self.g_lora.lora, "sigmoid", exact).float()  # (B, T, value_dim)
        kk = (k * self.k_k.float()).view(B, T, H, dk)  # (B, T, H, dk)
        kk = l2_normalize(kk, exact) if c.fuse_norm else kk / torch.clamp_min(
            numerics.sqrt(numerics.tree_sum(kk * kk, -1)) if exact else kk.norm(dim=-1), 1e-12)[..., None]
        k = k + k * (a - 1) * self.k_a.float()  # (B, T, C)
        heads = lambda t, d: t.view(B, T, H, d).transpose(1, 2)  # noqa: E731 - (B, T, H·d) → (B, H, T, d)
        kk = kk.transpose(1, 2)  # (B, H, T, dk)
        o, new["S"] = generalized_delta.run(heads(r, dk), heads(w, dk), heads(k, dk), heads(v, dv), -kk,
                                            kk * heads(a, dk), state["S"], exact, prefixes)  # (B, H, T, dv)
        o = self.group_norm(o.transpose(1, 2), exact)  # (B, T, H, dv)
        bonus = r.view(B, T, H, dk) * k.view(B, T, H, dk) * self.r_k.float()  # (B, T, H, dk)
        bonus = numerics.tree_sum(bonus, -1) if exact else bonus.sum(-1)  # (B, T, H)
        o = (o + bonus[..., None] * v.view(B, T, H, dv)).reshape(B, T, self.value_dim) * g  # (B, T, value_dim)
        return numerics.project(self.o_proj, o.to(x.dtype)), new, v_first  # (B, T, C)

    def group_norm(self, o: torch.Tensor, exact: bool) -> torch.Tensor:
        """GroupNorm over each head's values (fp32): (B, T, H, dv) → (B, T, H, dv)."""
        weight, bias = (p.float().view(o.shape[-2:]) for p in (self.g_norm.weight, self.g_norm.bias))  # (H, dv)
        if exact:
            return numerics.layer_norm(o, weight, bias, self.g_norm.eps)
        return F.layer_norm(o, o.shape[-1:], eps=self.g_norm.eps) * weight + bias


class ChannelMix(nn.Module):
    def __init__(self, config: RWKV7Config) -> None:
        super().__init__()
        self.config = config
        self.x_k = nn.Parameter(torch.zeros(config.hidden_size))
        self.key = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.value = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: dict, prefixes: bool, new: dict) -> torch.Tensor:
        delta, new["shift_ffn"] = shifted(x, state["shift_ffn"], prefixes)
        act = "silu" if self.config.hidden_act == "swish" else self.config.hidden_act
        hidden = numerics.activation(act, numerics.project(self.key, mix(x, delta, self.x_k)))  # (B, T, I)
        return numerics.project(self.value, hidden)  # (B, T, C)


class RWKV7Block(nn.Module):
    def __init__(self, config: RWKV7Config, layer_index: int) -> None:
        super().__init__()
        norm = lambda: nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)  # noqa: E731
        if config.norm_first and layer_index == 0:
            self.pre_norm = norm()
        self.attn_norm = norm()
        self.attn = TimeMix(config, layer_index)
        self.ffn_norm = norm()
        self.ffn = ChannelMix(config)

    def forward(self, x: torch.Tensor, state: dict, prefixes: bool,
                v_first: torch.Tensor | None) -> tuple[torch.Tensor, dict, torch.Tensor]:
        if hasattr(self, "pre_norm"):
            x = numerics.normalize(self.pre_norm, x)  # (B, T, C): layer 0's residual starts normalised
        exact = numerics.exact_inference(x)
        h, new, v_first = self.attn(numerics.normalize(self.attn_norm, x), state, exact, prefixes, v_first)
        x = x + h
        x = x + self.ffn(numerics.normalize(self.ffn_norm, x), state, prefixes, new)
        return x, new, v_first


class RWKV7Backbone(nn.Module):
    """`model.embeddings`, `model.layers.{i}`, `model.norm` — fla's names."""

    def __init__(self, config: RWKV7Config) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(RWKV7Block(config, i) for i in range(config.n_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def run_layers(self, x: torch.Tensor, states: tuple[dict, ...],
                   prefixes: bool) -> tuple[torch.Tensor, list[dict]]:
        """The layers in turn, layer 0's v carried to the others (v_first)."""
        v_first, out = None, []
        for block, state in zip(self.layers, states):
            x, new, v_first = block(x, state, prefixes, v_first)
            out.append(new)
        return x, out

    def final_norm(self, x: torch.Tensor, exact: bool) -> torch.Tensor:
        return numerics.normalize(self.norm, x)


def build(raw: dict) -> FlaCausalLM:
    config = RWKV7Config.from_raw(raw)
    return FlaCausalLM(config, backbone=RWKV7Backbone(config))
