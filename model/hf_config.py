"""`LinearGPTConfig`, the Hugging Face config of a LinearGPT, registered with `AutoConfig` — apart from the model
class (hf.py) so that `import linserve.model` and the server never import transformers' modeling code (a second
or two of every start).

`AutoModelForCausalLM` still finds `linear_gpt` after a bare `import linserve.model`: the first LinearGPTConfig
made (read from a config.json by `from_dict`, or constructed) imports hf.py, which registers the model class for
this config class — before any Auto class looks it up.
"""

from __future__ import annotations

import dataclasses
import importlib

from transformers import AutoConfig, PreTrainedConfig

from .config import ModelConfig

MODEL_TYPE = "linear_gpt"


def _register_model_class() -> None:
    importlib.import_module(f"{__package__}.hf")  # (registers LinearGPTForCausalLM; once, then a dict lookup)


class _ModelConfigBridge:
    """Conversion between the HF config and linserve's own ModelConfig (whose defaults are the only ones), and the
    hooks that register the model class with the Auto classes."""

    def to_model_config(self) -> ModelConfig:
        return ModelConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ModelConfig)})

    @classmethod
    def from_model_config(cls, config: ModelConfig, **kwargs) -> LinearGPTConfig:
        return cls(**config.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        _register_model_class()  # AutoConfig.from_pretrained (and AutoModelForCausalLM's) reads config.json here
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs) -> None:
        _register_model_class()  # a config constructed directly (transformers' dataclass configs call this)
        super().__post_init__(**kwargs)


def _config_namespace() -> dict:
    """LinearGPTConfig's dataclass fields: exactly ModelConfig's, with its defaults."""
    annotations, namespace = {}, {}
    for f in dataclasses.fields(ModelConfig):
        annotations[f.name] = f.type
        namespace[f.name] = f.default
    namespace.update(
        __annotations__=annotations,
        __module__=__name__,
        __doc__="Hugging Face config of a LinearGPT; fields and defaults are those of model.ModelConfig.",
        model_type=MODEL_TYPE,
        keys_to_ignore_at_inference=["state"],
        attribute_map={"hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads"},
    )
    return namespace


LinearGPTConfig = type("LinearGPTConfig", (_ModelConfigBridge, PreTrainedConfig), _config_namespace())

AutoConfig.register(MODEL_TYPE, LinearGPTConfig, exist_ok=True)
