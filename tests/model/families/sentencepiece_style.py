"""A sentencepiece-style tokenizer (Llama's layout: "▁" for spaces, a leading "▁", byte fallback for what the
vocabulary lacks, <s> prepended) trained here in a second on the repository's own docs — the kind of tokenizer
fla checkpoints usually carry, made without a download."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import LlamaTokenizerFast

REPO = Path(__file__).resolve().parents[3]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(directory: Path, vocab_size: int = 1024, chat_template: bool = True) -> LlamaTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(BYTES), special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    texts = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))] + [(REPO / "README.md").read_text()]
    # one sequence a whitespace-separated word, as sentencepiece splits by whitespace before it merges: without a
    # pre-tokenizer each whole document would be one "word" to the trainer, whose time grows with the word's square
    # (the docs at 744 KB: 128 s; by word: a second)
    tokenizer.train_from_iterator((word for text in texts for word in text.split()), trainer)
    # the 256 byte tokens as ordinary vocabulary (ids 3…258, as in Llama's), the learned pieces after them
    layout = json.loads(tokenizer.to_str())
    learned = sorted(layout["model"]["vocab"].items(), key=lambda item: item[1])
    vocab = {token: i for i, (token, _) in enumerate(learned[:3])}
    vocab.update({token: 3 + i for i, token in enumerate(BYTES)})
    vocab.update({token: len(vocab) + i for i, (token, _) in enumerate(learned[3:])})
    layout["model"]["vocab"] = vocab
    tokenizer = Tokenizer.from_str(json.dumps(layout))
    fast = LlamaTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                              add_bos_token=True, add_eos_token=False, legacy=False)
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast
