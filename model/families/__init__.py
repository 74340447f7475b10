"""Model families: one module per `model_type` a checkpoint's config.json may name.

Every family gives the server the same interface (model/interface.py; fla_base.FlaCausalLM, linear_gpt.LinearGPT):
`config` (attention, n_layers, vocab_size, to_dict(), state_bytes()), `init_state(B, device)`,
`state_from_tensors(name → tensor)`, `forward(ids, state, key_mask, prefixes) -> (logits, state)`.
`build(config_dict)` makes a family's model (random weights) from its config.json; checkpoint.py loads one.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from . import delta_net, gated_deltanet, gla, linear_attn, linear_gpt, mamba2, retnet, rwkv7
from .fla_base import FlaCausalLM, RecurrentState, UnsupportedCheckpoint

LINEAR_GPT = "linear_gpt"  # the shipped family (linserve's own; its config.json predates the field)
FLA_FAMILIES: dict[str, Callable[[dict], nn.Module]] = {"linear_attn": linear_attn.build, "gla": gla.build,
                                                       "retnet": retnet.build, "delta_net": delta_net.build,
                                                       "gated_deltanet": gated_deltanet.build, "rwkv7": rwkv7.build,
                                                       "mamba2": mamba2.build}
FAMILIES: dict[str, Callable[[dict], nn.Module]] = {LINEAR_GPT: linear_gpt.build, **FLA_FAMILIES}  # model_type → build
MODEL_TYPES = tuple(FAMILIES)


def build(raw: dict) -> nn.Module:
    """The served model of a config.json's fields (random weights), by its `model_type`: the family module's
    `build`. Raises UnsupportedCheckpoint naming the field for anything not served."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedCheckpoint("model_type", model_type, f"served model types: {', '.join(MODEL_TYPES)}")
    return FAMILIES[model_type](raw)


__all__ = ["FlaCausalLM", "RecurrentState", "UnsupportedCheckpoint", "build", "MODEL_TYPES", "FAMILIES",
           "FLA_FAMILIES", "LINEAR_GPT"]
