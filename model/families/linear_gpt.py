"""linserve's own family, `linear_gpt` (the shipped model; what `linserve train` writes) — LinearGPT: token
embedding → pre-LN blocks → final norm → tied LM head, state passed explicitly. Its attention kinds, feature maps
and state live beside it in model/ (attention.py, linear_attention.py, state.py), shared with training."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import numerics
from ..attention import build_attention
from ..config import ModelConfig
from ..state import BlockState, LinearAttentionState, ModelState
from .common import at_positions


class ShortConv(nn.Module):
    """Causal depthwise convolution over time: y_t = Σ_i w_i ⊙ x_{t-i}, i < kernel.

    Its window of the last kernel-1 inputs is part of the session state, so it gives the model word
    order without capping the context length. Initialised to the identity (w_0 = 1).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.window = config.conv_window
        weight = torch.zeros(config.d_model, config.conv_kernel)  # (C, K): last tap = current token
        weight[:, -1] = 1.0
        self.weight = nn.Parameter(weight)

    def init_state(self, batch: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(batch, self.window, self.weight.shape[0], device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor, window: torch.Tensor | None,
                prefixes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) → y (B, T, C) and the window after the T inputs (B, W, C) — or, with `prefixes`, the
        window after every prefix (B, T, W, C)."""
        B, T, _ = x.shape
        if window is None:
            window = self.init_state(B, x.device)
        padded = torch.cat([window.to(x.dtype), x], dim=1)  # (B, W+T, C)
        taps = self.weight.to(x.dtype).T  # (K, C)
        # K shifted multiply-adds: for the few taps of a short convolution (and T = 1 when decoding) this
        # is far cheaper than a depthwise conv1d call
        y = padded[:, : T] * taps[0]  # (B, T, C)
        for k in range(1, taps.shape[0]):
            y = y + padded[:, k : k + T] * taps[k]  # (B, T, C)
        if prefixes:  # window after input j: padded[j+1 : j+1+W]
            windows = padded.unfold(1, self.window, 1)[:, 1:]  # (B, T, C, W)
            return y, windows.transpose(-1, -2).float()  # (B, T, C), (B, T, W, C)
        return y, padded[:, T:].float()  # (B, T, C), (B, W, C)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.d_mlp, bias=False)
        self.down = nn.Linear(config.d_mlp, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return numerics.project(self.down, numerics.gelu(numerics.project(self.up, x)))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.conv = ShortConv(config) if config.conv_kernel else None
        self.attn = build_attention(config, layer_index)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def init_state(self, batch: int, device: torch.device | str) -> BlockState:
        conv = self.conv.init_state(batch, device) if self.conv is not None else None
        return BlockState(attn=self.attn.init_state(batch, device), conv=conv)

    def forward(
        self, x: torch.Tensor, state: BlockState, key_mask: torch.Tensor | None = None, prefixes: bool = False
    ) -> tuple[torch.Tensor, BlockState]:
        h = numerics.normalize(self.ln_1, x)  # (B, T, C)
        if key_mask is not None:
            h = h * key_mask[..., None].to(h.dtype)  # padding enters no window
        conv_state = state.conv
        if self.conv is not None:
            h, conv_state = self.conv(h, state.conv, prefixes)  # (B, T, C)
        a, attn_state = self.attn(h, state.attn, key_mask, prefixes)  # (B, T, C)
        x = x + a
        x = x + self.mlp(numerics.normalize(self.ln_2, x))  # (B, T, C)
        return x, BlockState(attn=attn_state, conv=conv_state)


class LinearGPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)
        residual_std = config.init_std / math.sqrt(2 * config.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, std=residual_std)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)

    def init_state(self, batch: int, device: torch.device | str | None = None) -> ModelState:
        device = device if device is not None else self.wte.weight.device
        return ModelState(blocks=tuple(block.init_state(batch, device) for block in self.blocks))

    def state_from_tensors(self, tensors: dict[str, torch.Tensor]) -> ModelState:
        """The inverse of `ModelState.tensors()` (the model interface: families/__init__.py); for a linear model
        built field by field (a compiler traces it: no `dataclasses.fields`)."""
        if self.config.attention != "linear":
            return ModelState.from_tensors(tensors, self.config.n_layers, self.config.attention)
        return ModelState(blocks=tuple(
            BlockState(attn=LinearAttentionState(S=tensors[f"blocks.{i}.S"], z=tensors[f"blocks.{i}.z"]),
                       conv=tensors.get(f"blocks.{i}.conv")) for i in range(self.config.n_layers)))

    def pooled_state_names(self) -> list[str]:
        """Each layer's S is read from the pool in place by the decode step (model/pooled_state.py); z, d_k
        floats a head, is gathered."""
        return [f"blocks.{i}.S" for i in range(self.config.n_layers)] if self.config.attention == "linear" else []

    def folded_state_names(self) -> list[str]:
        """Each pooled S's commit is noted for the next step's read (model/pooled_state.py)."""
        return self.pooled_state_names()

    def state_bytes(self, context_len: int = 0) -> int:
        """Bytes of one session's state, computed from the config (see ModelConfig.state_bytes)."""
        return self.config.state_bytes(context_len)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        ids: torch.Tensor,
        state: ModelState | None = None,
        key_mask: torch.Tensor | None = None,
        prefixes: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ModelState]:
        """ids (B, T) → logits (B, T, V) and the state after those tokens.

        `state=None` starts from the empty state. `key_mask` (B, T) marks left padding with 0: those
        positions leave the state untouched (exact for linear attention). `prefixes` (linear attention):
        the returned state holds the state after every prefix — each tensor (B, T, …), index j the state
        after tokens 0..j (`ModelState.select_prefix` picks one per row): speculative decoding's rollback.
        `logits_at` (B,): the head runs at each row's one position only, logits (B, V) — a prompt chunk's last.
        """
        B, T = ids.shape
        if state is None:
            state = self.init_state(B, ids.device)
        x = self.wte(ids)  # (B, T, C)
        new_blocks = []
        for block, block_state in zip(self.blocks, state.blocks):
            x, block_state = block(x, block_state, key_mask, prefixes)  # (B, T, C)
            new_blocks.append(block_state)
        x = at_positions(x, logits_at)  # (B, T, C), or (B, C) at each row's one position
        x = numerics.normalize(self.ln_f, x)  # (B, T, C)
        head = numerics.linear if numerics.exact_inference(x) else F.linear
        logits = head(x, self.wte.weight)  # (B, T, V) tied head
        return logits, ModelState(blocks=tuple(new_blocks))


def build(raw: dict) -> LinearGPT:
    """The family's model of a config.json's fields (random weights)."""
    return LinearGPT(ModelConfig.from_dict(raw))
