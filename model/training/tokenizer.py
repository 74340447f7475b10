"""Byte-level BPE tokenizer trained with `tokenizers`; saved so `AutoTokenizer.from_pretrained` loads it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOT_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every UTF-8 byte is in the base alphabet, so any text round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers view: EOT as bos/eos/pad, no clean-up that would alter decoded text."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT_TOKEN,
        eos_token=EOT_TOKEN,
        pad_token=EOT_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json (loadable with AutoTokenizer)."""
    wrap(tokenizer).save_pretrained(str(directory))


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))
