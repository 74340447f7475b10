"""What fla's linear families share: their config as linserve reads it, the blocks around the token mixer
(RMSNorm, the gated SwiGLU MLP, the short convolution), the per-layer recurrent state and the causal LM.

A family module (linear_attn.py, gla.py, retnet.py) supplies only its mixer and the options it reads. The
module tree and parameter names are fla's own (`model.layers.{i}.attn.q_proj.weight`, …), so an fla checkpoint
loads strictly: every tensor is matched by name and shape, none missing, none left over (checkpoint.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import numerics
from .common import UnsupportedCheckpoint, at_positions, rope_cos_sin, rotate  # noqa: F401 - re-exported to the families
from .window_attention import SlidingWindowAttention, read_window_layers, window_state_shapes

Tensor = torch.Tensor


MLP_ACTIVATIONS = ("swish", "powlu")  # what fla's GatedMLP computes (SwiGLU, PowGLU)


# ---------------------------------------------------------------------------------------------- config
@dataclass
class FlaConfig:
    """An fla checkpoint's config.json, as read: the raw fields (`raw`, the cache and snapshot key) and the
    shapes every family shares. `attention`, `n_layers`, `vocab_size` and `state_bytes()` are the model
    interface the server reads (as it reads them of linear_gpt's ModelConfig)."""

    raw: dict
    model_type: str
    hidden_size: int
    n_layers: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    norm_eps: float
    elementwise_affine: bool
    intermediate_size: int
    tie_word_embeddings: bool
    hidden_act: str
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per layer: name → shape at batch 1
    attn_layers: dict[int, dict] = field(default_factory=dict)  # a hybrid's sliding-window softmax layers
    attention: str = "linear"
    max_context: int | None = None  # no limit: the state does not grow

    def to_dict(self) -> dict:
        return dict(self.raw)

    def layer_state_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """Layer `index`'s state: the family's, or a sliding-window layer's keys, values and position."""
        return self._layer_shapes[index]

    @cached_property
    def _layer_shapes(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """Every layer's state shapes, made once (after the family's reader set `state_shapes`)."""
        return tuple(window_state_shapes(self, self.attn_layers[i]) if i in self.attn_layers else self.state_shapes
                     for i in range(self.n_layers))

    def state_bytes(self, context_len: int = 0) -> int:
        """Bytes of one session's state — from the config alone, whatever `context_len` is."""
        return sum(math.prod(shape) * (8 if name == "position" else 4)
                   for index in range(self.n_layers) for name, shape in self.layer_state_shapes(index).items())

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads


def expanded_dim(raw: dict, hidden: int, name: str, default: float) -> int:
    """hidden × expand_k / expand_v: an integer, as fla asserts."""
    ratio = raw.get(name, default)
    dim = hidden * ratio
    if not math.isclose(dim, round(dim)):
        raise UnsupportedCheckpoint(name, ratio, f"hidden_size × {name} must be an integer")
    return round(dim)


def read_shared(raw: dict, defaults: dict, dims: tuple[int, int] | None = None) -> dict:
    """The fields every fla family has, with fla 0.6.0's defaults for the family (`defaults`), refusing what
    would not keep a fixed-size state or what linserve does not compute. `dims`: the family's own (key_dim,
    value_dim) where it does not size them by expand_k / expand_v."""
    get = lambda name: raw.get(name, defaults.get(name))  # noqa: E731 - fla's default when the field is absent
    if get("attnres_block_size") is not None:
        raise UnsupportedCheckpoint("attnres_block_size", get("attnres_block_size"),
                                    "attention residuals (AttnRes) are not served; null is")
    if get("hidden_act") not in MLP_ACTIVATIONS:
        raise UnsupportedCheckpoint("hidden_act", get("hidden_act"), f"fla's gated MLP: {' or '.join(MLP_ACTIVATIONS)}")
    hidden, heads = int(get("hidden_size")), int(get("num_heads"))
    kv_heads = int(get("num_kv_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedCheckpoint("num_kv_heads", kv_heads, f"a divisor of num_heads ({heads})")
    if dims is None:
        key_dim = expanded_dim(raw, hidden, "expand_k", defaults["expand_k"])
        value_dim = expanded_dim(raw, hidden, "expand_v", defaults["expand_v"])
        for name, dim in (("expand_k", key_dim), ("expand_v", value_dim)):
            if dim % heads:
                raise UnsupportedCheckpoint(name, raw.get(name),
                                            f"hidden_size × {name} divisible by num_heads ({heads})")
    else:
        key_dim, value_dim = dims
    intermediate = get("intermediate_size")
    if intermediate is None:  # fla's GatedMLP: 2/3 · hidden · ratio, rounded up to a multiple of 256
        ratio = get("hidden_ratio") or 4
        intermediate = int(hidden * ratio * 2 / 3)
        intermediate = 256 * ((intermediate + 255) // 256)
    n_layers = int(get("num_hidden_layers"))
    return dict(raw=raw, model_type=raw["model_type"], hidden_size=hidden, n_layers=n_layers,
                attn_layers=read_window_layers(get("attn"), n_layers, hidden),
                vocab_size=int(get("vocab_size")), num_heads=heads, num_kv_heads=kv_heads, key_dim=key_dim,
                value_dim=value_dim, norm_eps=float(get("norm_eps")),
                elementwise_affine=bool(get("elementwise_affine") if get("elementwise_affine") is not None else True),
                intermediate_size=int(intermediate), tie_word_embeddings=bool(get("tie_word_embeddings")),
                hidden_act=get("hidden_act"))


# ---------------------------------------------------------------------------------------------- state
@dataclass(frozen=True)
class RecurrentState:
    """A batch of B sessions' state: per layer, named fixed-size tensors (fp32; a RetNet position int64),
    each (B, …). Flat names `layers.{i}.{name}` are the pool's, the snapshots' and the compiled programs'."""

    layers: tuple[dict[str, Tensor], ...]

    def tensors(self) -> dict[str, Tensor]:
        return {f"layers.{i}.{name}": t for i, layer in enumerate(self.layers) for name, t in layer.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], n_layers: int) -> RecurrentState:
        layers: list[dict[str, Tensor]] = [{} for _ in range(n_layers)]
        for key, tensor in tensors.items():
            _, index, name = key.split(".", 2)
            layers[int(index)][name] = tensor
        return cls(layers=tuple(layers))

    def map(self, fn: Callable[[Tensor], Tensor]) -> RecurrentState:
        return RecurrentState(layers=tuple({name: fn(t) for name, t in layer.items()} for layer in self.layers))

    def select_prefix(self, kept: Tensor) -> RecurrentState:
        """From a state after every prefix (each tensor (B, T, …)), row b's after its first kept[b] + 1 tokens."""
        rows = torch.arange(kept.shape[0], device=kept.device)  # (B,)
        return self.map(lambda t: t[rows, kept])

    is_linear = True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def clone(self) -> RecurrentState:
        return self.map(torch.clone)

    def to(self, device: torch.device | str) -> RecurrentState:
        return self.map(lambda t: t.to(device))


# ---------------------------------------------------------------------------------------------- blocks
class RMSNorm(nn.Module):
    """fla's RMSNorm (and nn.RMSNorm): fp32 statistics, an optional weight; parameter `weight`."""

    def __init__(self, size: int, eps: float, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if affine else None

    def forward(self, x: Tensor, exact: bool, out_dtype: torch.dtype | None = None) -> Tensor:
        return numerics.rms_norm(x, self.weight, self.eps, exact, out_dtype)


class GatedMLP(nn.Module):
    """fla's GatedMLP: down(act(gate(x)) · up(x)), act SiLU ('swish') or PowGLU's gate ('powlu')."""

    def __init__(self, config: FlaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = "silu" if config.hidden_act == "swish" else config.hidden_act

    def forward(self, x: Tensor) -> Tensor:
        gate, up = numerics.project_all([self.gate_proj, self.up_proj], x)  # (B, T, I) each
        return numerics.project(self.down_proj, numerics.activation(self.act, gate) * up)  # (B, T, C)


class ShortConvolution(nn.Module):
    """fla's ShortConvolution (a depthwise causal Conv1d, then SiLU or no activation): parameters `weight`
    (D, 1, W) and an optional `bias` (D,). Its state is the last W - 1 inputs, (B, W - 1, D) fp32."""

    def __init__(self, size: int, kernel: int, bias: bool, activation: str | None = "silu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, 1, kernel))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.window = kernel - 1
        self.activation = activation

    def forward(self, x: Tensor, window: Tensor, prefixes: bool = False) -> tuple[Tensor, Tensor]:
        """x (B, T, D) → silu(conv(x)) (B, T, D) and the window after (B, W-1, D), or after every prefix
        (B, T, W-1, D)."""
        T = x.shape[1]
        padded = torch.cat([window.to(x.dtype), x], dim=1)  # (B, W-1+T, D)
        taps = self.weight[:, 0].to(x.dtype).T  # (W, D): tap j multiplies input t - (W-1) + j
        y = padded[:, :T] * taps[0]  # (B, T, D)
        for j in range(1, taps.shape[0]):
            y = y + padded[:, j:j + T] * taps[j]  # (B, T, D)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.activation is not None:
            y = numerics.activation(self.activation, y)  # (B, T, D)
        if prefixes:
            windows = padded.unfold(1, self.window, 1)[:, 1:]  # (B, T, D, W-1)
            return y, windows.transpose(-1, -2).float()  # (B, T, W-1, D)
        return y, padded[:, T:].float()  # (B, W-1, D)


def project_qkv(mixer: nn.Module, x: Tensor, state: dict, prefixes: bool, new: dict,
                also: tuple[nn.Linear, ...] = ()) -> list[Tensor]:
    """A mixer's q/k/v projections (`q_proj`, `k_proj`, `v_proj`), each through its short convolution
    (`q_conv1d`, …) when `mixer.config.use_short_conv`, whose windows go into `new`; then the projections of x by
    the layers `also` (an output gate's), computed in the same kernel call. (B, T, ·) each."""
    q, k, v, *rest = numerics.project_all([mixer.q_proj, mixer.k_proj, mixer.v_proj, *also], x)  # (B, T, ·) each
    if mixer.config.use_short_conv:
        q, new["conv_q"] = mixer.q_conv1d(q, state["conv_q"], prefixes)
        k, new["conv_k"] = mixer.k_conv1d(k, state["conv_k"], prefixes)
        v, new["conv_v"] = mixer.v_conv1d(v, state["conv_v"], prefixes)
    return [q, k, v, *rest]


def repeat_groups(x: Tensor, heads: int, dim: int) -> Tensor:
    """(B, T, kv·dim) → (B, T, heads, dim): each kv head repeated heads/kv times in place (fla's
    '... (h d) -> ... (h g) d')."""
    B, T, width = x.shape
    kv = width // dim
    x = x.view(B, T, kv, dim)  # (B, T, kv, d)
    return x if kv == heads else x.repeat_interleave(heads // kv, dim=2)  # (B, T, H, d)


class Block(nn.Module):
    """attn_norm → mixer → residual → mlp_norm → GatedMLP → residual (fla's block layout)."""

    def __init__(self, config: FlaConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = mixer
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = GatedMLP(config)

    def forward(self, x: Tensor, state: dict[str, Tensor], prefixes: bool) -> tuple[Tensor, dict[str, Tensor]]:
        exact = numerics.exact_inference(x)
        a, state = self.attn(self.attn_norm(x, exact), state, exact, prefixes)  # (B, T, C)
        x = x + a
        return x + self.mlp(self.mlp_norm(x, exact)), state  # (B, T, C)


class Backbone(nn.Module):
    def __init__(self, config: FlaConfig, make_mixer: Callable[[FlaConfig, int], nn.Module]) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, SlidingWindowAttention(config, config.attn_layers[i]) if i in config.attn_layers
                  else make_mixer(config, i)) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def final_norm(self, x: Tensor, exact: bool) -> Tensor:
        return self.norm(x, exact)


class FlaCausalLM(nn.Module):
    """An fla linear-family causal LM with the model interface the server uses:

        forward(ids (B, T), state | None, key_mask=None, prefixes=False, logits_at=None) -> (logits (B, T, V), state)
        init_state(B, device) · state_from_tensors(name → tensor) · state_bytes() · config

    `prefixes`: the state after every prefix, each tensor (B, T, …) (speculative verification); `logits_at` (B,):
    the logits at each row's one position only, (B, V) (a prompt chunk's last: the prefill program).

    The backbone (embeddings, layers, final_norm) is `model` as fla names it for the attention-like families;
    a family laid out otherwise (Mamba2's `backbone`) passes its own and the attribute's name."""

    def __init__(self, config: FlaConfig, make_mixer: Callable[[FlaConfig, int], nn.Module] | None = None,
                 backbone: nn.Module | None = None, backbone_name: str = "model") -> None:
        super().__init__()
        self.config = config
        self.backbone_name = backbone_name
        self.add_module(backbone_name, backbone if backbone is not None else Backbone(config, make_mixer))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.body.embeddings.weight

    @property
    def body(self) -> nn.Module:
        """The backbone: `embeddings`, `layers` (each block(x, layer state, prefixes)) and `final_norm`."""
        return getattr(self, self.backbone_name)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> RecurrentState:
        device = device if device is not None else self.lm_head.weight.device
        return RecurrentState(layers=tuple(
            {name: torch.zeros((batch, *shape), device=device,
                               dtype=torch.int64 if name == "position" else torch.float32)
             for name, shape in self.config.layer_state_shapes(index).items()}
            for index in range(self.config.n_layers)))

    def state_from_tensors(self, tensors: dict[str, Tensor]) -> RecurrentState:
        return RecurrentState.from_tensors(tensors, self.config.n_layers)

    def state_bytes(self, context_len: int = 0) -> int:
        return self.config.state_bytes(context_len)

    def pooled_state_names(self) -> list[str]:
        """The state tensors whose one-token update the layers leave in the pool (pooled_state.py): each mixer's
        `pooled_state` (a sliding-window layer's or RWKV-7's: none)."""
        return self._mixer_state_names("pooled_state")

    def folded_state_names(self) -> list[str]:
        """Those whose commit is noted for the next read (pooled_state.py): each mixer's `folded_state` (the delta
        rule's and the gated linear recurrence's)."""
        return self._mixer_state_names("folded_state")

    def _mixer_state_names(self, attribute: str) -> list[str]:
        names = []
        for index, block in enumerate(self.body.layers):
            mixer = getattr(block, "attn", None) or getattr(block, "mixer", None)
            names += [f"layers.{index}.{name}" for name in getattr(mixer, attribute, ())]
        return names

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: Tensor, state: RecurrentState | None = None, key_mask: Tensor | None = None,
                prefixes: bool = False, logits_at: Tensor | None = None) -> tuple[Tensor, RecurrentState]:
        if key_mask is not None:
            raise ValueError("fla families take rows without padding (key_mask is not supported)")
        B, T = ids.shape
        if state is None:
            state = self.init_state(B, ids.device)
        x = self.body.embeddings(ids).to(self.lm_head.weight.dtype)  # (B, T, C)
        if hasattr(self.body, "run_layers"):  # layers that pass more than x along (RWKV-7's v_first)
            x, states = self.body.run_layers(x, state.layers, prefixes)  # (B, T, C)
        else:
            states = []
            for block, layer_state in zip(self.body.layers, state.layers):
                x, layer_state = block(x, layer_state, prefixes)  # (B, T, C)
                states.append(layer_state)
        layers = [{name: layer_state[name] for name in self.config.layer_state_shapes(index)}  # pool order
                  for index, layer_state in enumerate(states)]
        x = at_positions(x, logits_at)  # (B, T, C), or (B, C) at each row's one position
        x = self.body.final_norm(x, numerics.exact_inference(x))  # (B, T, C)
        head = numerics.linear if numerics.exact_inference(x) else F.linear
        return head(x, self.lm_head.weight), RecurrentState(layers=tuple(layers))  # (B, T, V)
