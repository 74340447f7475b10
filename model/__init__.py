"""linserve's model: a GPT-style decoder with causal linear attention and an explicit recurrent state.

Importing this package registers `linear_gpt` with transformers' AutoConfig / AutoModelForCausalLM.
"""

from .config import ModelConfig
from .gpt import LinearGPT
from .hf import LinearGPTConfig, LinearGPTForCausalLM
from .state import BlockState, KVCacheState, LinearAttentionState, ModelState

__all__ = [
    "ModelConfig",
    "LinearGPT",
    "LinearGPTConfig",
    "LinearGPTForCausalLM",
    "ModelState",
    "BlockState",
    "LinearAttentionState",
    "KVCacheState",
]
