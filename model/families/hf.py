"""Hugging Face `generate()` over any served family — the hand-over model/hf.py makes for linear_gpt, through
the model interface alone: the family's fixed-size state is the cache, fed one token per step.

    lm = FamilyForCausalLM.from_checkpoint(DIR)          # an fla directory, strictly loaded (checkpoint.py)
    out = lm.generate(input_ids, max_new_tokens=50, do_sample=False)

(fla's own classes generate too, with fla's kernels; this one runs linserve's forms, on a CPU without
triton.) Rows must not be padded: the fla families take no key mask.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel

from ..hf import LinearGPTOutput, stateful_inputs


class FamilyConfig(PreTrainedConfig):
    """The family's config.json fields under `family`; bos/eos/pad ids as the checkpoint gives them."""

    model_type = "linserve_family"

    def __init__(self, family: dict | None = None, **kwargs) -> None:
        self.family = dict(family or {})
        kwargs.setdefault("tie_word_embeddings", False)  # the family model ties its own head
        super().__init__(**kwargs)


class FamilyForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FamilyConfig
    base_model_prefix = "family"
    main_input_name = "input_ids"
    _is_stateful = True

    def __init__(self, config: FamilyConfig, family_model: torch.nn.Module | None = None) -> None:
        super().__init__(config)
        from . import build

        self.family = family_model if family_model is not None else build(config.family)
        self.post_init()

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> FamilyForCausalLM:
        from ..checkpoint import load_checkpoint, read_config

        raw = read_config(Path(path))
        model = load_checkpoint(path, torch.device(device), dtype)
        config = FamilyConfig(family=raw, **{k: raw.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        return cls(config, model).eval()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """The family model arrives built (and loaded)."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the family's fixed-size state

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.family.body.embeddings

    def get_output_embeddings(self) -> None:
        return None  # the head belongs to the family model (tied there if its config says so)

    def forward(self, input_ids: torch.LongTensor, state=None, attention_mask: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs) -> LinearGPTOutput:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("fla families take rows without padding: generate one prompt per call, or equal lengths")
        logits, new_state = self.family(input_ids, state)  # (B, T, V)
        return LinearGPTOutput(logits=logits, state=new_state if use_cache is not False else None)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, state=None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = None,
                                      **kwargs) -> dict:
        return stateful_inputs(input_ids, state, attention_mask, use_cache)

    def _update_model_kwargs_for_generation(self, outputs: LinearGPTOutput, model_kwargs: dict, *args,
                                            **kwargs) -> dict:
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        model_kwargs["state"] = outputs.state  # the next step's cache, whatever this transformers calls it
        return model_kwargs
