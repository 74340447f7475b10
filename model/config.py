"""ModelConfig: the one description of a LinearGPT's shape, and every size derived from it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

ATTENTION_KINDS = ("linear", "softmax")
FEATURE_MAPS = ("elu1", "relu", "favor")
STATE_DTYPE_BYTES = 4  # (S, z) and the convolution window are always fp32


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of a LinearGPT.

    vocab_size:    number of token ids.
    d_model:       residual stream width.
    n_layers:      number of pre-LN blocks.
    n_heads:       attention heads per block.
    head_dim:      per-head width of q, k and v (d_k = d_v = head_dim); None means d_model // n_heads.
    mlp_ratio:     MLP hidden width as a multiple of d_model.
    attention:     "linear" (fixed-size (S, z) state) or "softmax" (KV cache; the measured baseline).
    feature_map:   φ for linear attention: "elu1" (ELU+1), "relu" (ReLU + eps) or "favor" (FAVOR+).
    favor_features: number of FAVOR+ random features m (the d_k of the state when feature_map="favor").
    decay:         per-head decay γ_h = 1 - 2^(-5-h·4/H) (RetNet-style); for softmax it becomes the
                   equivalent ALiBi-style bias (i-j)·log γ_h.
    conv_kernel:   width of a causal depthwise convolution over each block's normalised input
                   (0 = none, 2 = token shift); its window of kernel-1 inputs is part of the state.
    chunk_size:    chunk length of the parallel (prefill/training) form.
    eps:           added to the linear attention denominator φ(q)ᵀz (and to ReLU features).
    init_std:      standard deviation of the weights at initialisation.
    seed:          seed of the FAVOR+ projection draw (made once at init, saved with the weights).
    """

    vocab_size: int = 4096
    model_type: ClassVar[str] = "linear_gpt"  # the family (config.json's field; model/families/linear_gpt.py)
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 8
    head_dim: int | None = None
    mlp_ratio: float = 4.0
    attention: str = "linear"
    feature_map: str = "elu1"
    favor_features: int = 64
    decay: bool = False
    conv_kernel: int = 0
    chunk_size: int = 64
    eps: float = 1e-6
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "chunk_size", "favor_features"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.conv_kernel < 0 or self.conv_kernel == 1:
            raise ValueError("conv_kernel must be 0 (off) or >= 2")

    # ---- derived sizes: the only place they are computed ----
    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def d_attn(self) -> int:
        """Width of the concatenated heads (q, k, v projections)."""
        return self.n_heads * self.d_head

    @property
    def d_feature(self) -> int:
        """d_k of the recurrent state: the feature map's output width."""
        return self.favor_features if self.feature_map == "favor" else self.d_head

    @property
    def d_mlp(self) -> int:
        return int(round(self.mlp_ratio * self.d_model))

    @property
    def conv_window(self) -> int:
        """Inputs the causal convolution remembers between calls."""
        return max(self.conv_kernel - 1, 0)

    def state_bytes(self, context_len: int = 0) -> int:
        """Bytes of one session's state, from the config alone.

        linear:  L·(H·d_k·d_v + H·d_k + W·d_model)·4   — independent of context_len.
        softmax: L·(2·H·T·d_head + W·d_model)·4         — the KV cache grows with T = context_len.
        """
        conv = self.conv_window * self.d_model
        if self.attention == "linear":
            per_layer = self.n_heads * self.d_feature * self.d_head + self.n_heads * self.d_feature + conv
        else:
            per_layer = 2 * self.n_heads * context_len * self.d_head + conv
        return self.n_layers * per_layer * STATE_DTYPE_BYTES

    # ---- persistence ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
