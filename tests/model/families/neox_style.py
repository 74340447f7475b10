"""A GPT-NeoX-style tokenizer (the Pile's 20B tokenizer layout, which RWKV-7's Pile models and Pythia carry: a
byte-level BPE, `<|endoftext|>` id 0 as bos and eos, `<|padding|>` id 1, nothing prepended) with two added special
tokens of a ChatML chat template, trained here in a second on the repository's docs — made without a download."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[3]
SPECIAL = ["<|endoftext|>", "<|padding|>"]
CHAT = ["<|im_start|>", "<|im_end|>"]  # added after training, as a chat fine-tune adds them
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(directory: Path, vocab_size: int = 1000) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))] + [(REPO / "README.md").read_text()]
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", pad_token="<|padding|>")
    fast.add_special_tokens({"additional_special_tokens": CHAT})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast
