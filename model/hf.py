"""Hugging Face integration: LinearGPTForCausalLM (its config: hf_config.py), registered with AutoModelForCausalLM.

The recurrent state travels through `generate()` as its cache, so each new token costs one recurrent step
instead of re-running the prefix. It is a fixed-size `ModelState`, not a `transformers.Cache` (a growing
KV cache with crop/offload/compile hooks that `generate()` calls on whatever it holds under the name
`cache`), so it keeps the name `state` — as transformers' own recurrent RWKV does — and the model hands it
from one step to the next itself (`_update_model_kwargs_for_generation`): transformers ≤ 5.23 copied a
`state` output by name, ≥ 5.24 copies only `cache`. `generate(..., return_dict_in_generate=True)` returns
the final state as the output's cache (`.cache` from 5.24, `.past_key_values` before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import ModelOutput

from .families.linear_gpt import LinearGPT
from .hf_config import LinearGPTConfig
from .state import ModelState


@dataclass
class LinearGPTOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    state: ModelState | None = None


class LinearGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LinearGPTConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _is_stateful = True
    _no_split_modules = ["Block"]

    def __init__(self, config: LinearGPTConfig) -> None:
        super().__init__(config)
        self.model = LinearGPT(config.to_model_config())
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """LinearGPT initialises itself; FAVOR+ projections are drawn in their constructors."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is our own fixed-size ModelState, not a growing KV cache

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.wte

    def set_input_embeddings(self, value: torch.nn.Embedding) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> None:
        return None  # the LM head reads the embedding matrix directly (tied, no separate weight)

    def forward(
        self,
        input_ids: torch.LongTensor,
        state: ModelState | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> LinearGPTOutput:
        key_mask = attention_mask if attention_mask is not None and not bool(attention_mask.all()) else None
        logits, new_state = self.model(input_ids, state, key_mask)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return LinearGPTOutput(loss=loss, logits=logits, state=new_state if use_cache is not False else None)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        state: ModelState | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> dict:
        return stateful_inputs(input_ids, state, attention_mask, use_cache)

    def _update_model_kwargs_for_generation(self, outputs: LinearGPTOutput, model_kwargs: dict, *args,
                                            **kwargs) -> dict:
        """Between two steps of `generate()`: the step's new state is the next step's `state` (read by
        `prepare_inputs_for_generation`), whatever name this transformers version carries caches under."""
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        model_kwargs["state"] = outputs.state
        return model_kwargs


def stateful_inputs(input_ids: torch.LongTensor, state, attention_mask: torch.Tensor | None,
                    use_cache: bool | None) -> dict:
    """`prepare_inputs_for_generation` of a model whose cache is its fixed-size state (any family): once the
    state holds the prefix, only the newest token is fed, with no padding in it."""
    if state is not None:
        return {"input_ids": input_ids[:, -1:], "state": state, "use_cache": use_cache}
    return {"input_ids": input_ids, "state": None, "attention_mask": attention_mask, "use_cache": use_cache}


AutoModelForCausalLM.register(LinearGPTConfig, LinearGPTForCausalLM, exist_ok=True)
