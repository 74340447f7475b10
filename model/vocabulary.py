"""A checkpoint's vocabulary padded past its tokenizer, served as the tokenizer's.

Trained models routinely pad `vocab_size` to a multiple of 64 or 128 for the GPU (RWKV-7's Pile models: 50,304
rows for a 50,277-token tokenizer); the extra ids have no token — nothing can be prompted with them, and text
cannot be made from them. `serve_tokenizer_vocabulary` keeps only the rows the tokenizer can name: the embedding's
and the head's first `size` rows (a tied head is one tensor), the config's `vocab_size` set to `size`. So every
logit the model returns is a real token's — greedy, seeded sampling, speculation, structured outputs, logprobs and
`top_logprobs` see the tokenizer's vocabulary and nothing else, in every form (prefill, decode and verification
programs, compiled or eager), and the softmax is over it (vLLM drops a padded head's extra logits the same way).
A row of the head is its own output's weights: each kept logit is the same value as before the cut (linserve's
projection kernel reduces each output alone, so bit for bit).
"""

from __future__ import annotations

import dataclasses
from weakref import WeakKeyDictionary

import torch
from torch import nn

_PADDED: WeakKeyDictionary = WeakKeyDictionary()  # model → the checkpoint's vocab_size before the cut


class VocabularyError(ValueError):
    """The tokenizer names ids the model has no row for."""


def serve_tokenizer_vocabulary(model: nn.Module, size: int) -> int:
    """Cut the model's vocabulary to the tokenizer's `size` ids (nothing to do when they are equal); returns the
    checkpoint's vocab_size. A tokenizer larger than the vocabulary is refused (VocabularyError)."""
    padded = model.config.vocab_size
    if size > padded:
        raise VocabularyError(f"the tokenizer has {size} tokens but the model's vocab_size is {padded} "
                              f"(config.json): the model has no rows for ids {padded}..{size - 1}")
    if size == padded:
        return padded
    cut = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings == padded:
            _keep_rows(module.weight, size, cut)
            module.num_embeddings = size
        elif isinstance(module, nn.Linear) and module.out_features == padded:
            _keep_rows(module.weight, size, cut)
            if module.bias is not None:
                _keep_rows(module.bias, size, cut)
            module.out_features = size
    if dataclasses.is_dataclass(model.config):  # (linear_gpt's config is frozen)
        model.config = dataclasses.replace(model.config, vocab_size=size)
    else:
        model.config.vocab_size = size
    _PADDED[model] = padded
    return padded


def checkpoint_vocab_size(model: nn.Module) -> int:
    """The vocab_size the checkpoint was saved with (the served one unless its padding was cut)."""
    return _PADDED.get(model, model.config.vocab_size)


def _keep_rows(parameter: torch.Tensor, size: int, cut: set) -> None:
    if id(parameter) in cut:  # (a head tied to the embedding: one tensor, cut once)
        return
    parameter.data = parameter.data[:size].clone()  # (a copy: the padded rows' memory goes)
    cut.add(id(parameter))
