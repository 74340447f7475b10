"""linserve's model: a GPT-style decoder with causal linear attention and an explicit recurrent state.

Importing this package registers `linear_gpt` with transformers' AutoConfig / AutoModelForCausalLM (the model
class on the first LinearGPTConfig made: hf_config.py). `LinearGPTForCausalLM` is imported when first named, so
code that only serves a model never loads transformers' modeling code.
"""

from .config import ModelConfig
from .families.linear_gpt import LinearGPT
from .hf_config import LinearGPTConfig
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


def __getattr__(name: str):
    if name == "LinearGPTForCausalLM":
        from .hf import LinearGPTForCausalLM

        return LinearGPTForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
