"""An RWKV "world"-layout tokenizer built locally (never downloaded), as fla-hub's RWKV-7 checkpoints carry it:
`rwkv_vocab_v20230424.txt` (`id literal length` per line, id 0 the special <s>), a tokenizer_config.json naming
the checkpoint's own class through `auto_map` — and that class's file, which linserve must never run (here it
raises if imported)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from linserve.model.loading import DEFAULT_CHECKPOINT

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
                 "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
REMOTE_CODE = 'raise RuntimeError("the checkpoint\'s own tokenizer code was executed")\n'


def byte_level_tokens() -> list[bytes]:
    """The shipped byte-level BPE's multi-byte tokens, as bytes, in id order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    byte_of = {chr(b): b for b in printable}
    shifted = iter(range(256, 512))
    for b in range(256):
        if b not in printable:
            byte_of[chr(next(shifted))] = b
    vocab = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json")).get_vocab()
    return [bytes(byte_of[ch] for ch in token) for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])
            if all(ch in byte_of for ch in token) and len(token) > 1]


def literal(data: bytes) -> str:
    try:
        return repr(data.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(data)


def make_tokenizer(directory: Path, vocab_size: int = 1024):
    """Ids 1..255+: every single byte, then multi-byte tokens (the shipped BPE's, plus a few multi-byte
    characters and RWKV's "\\n\\n"), vocab_size − 1 entries in all."""
    from linserve.model.checkpoint import load_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    extra = ["\n\n".encode(), "é".encode(), "日本".encode(), "語".encode(), " café".encode()]
    tokens = [bytes([b]) for b in range(256)] + extra
    tokens += [t for t in byte_level_tokens() if t not in tokens][: vocab_size - 1 - len(tokens)]
    lines = [f"{index} {literal(data)} {len(data)}" for index, data in enumerate(tokens, 1)]
    (directory / "rwkv_vocab_v20230424.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (directory / "hf_rwkv_tokenizer.py").write_text(REMOTE_CODE)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Rwkv6Tokenizer", "auto_map": {"AutoTokenizer": ["hf_rwkv_tokenizer.Rwkv6Tokenizer", None]},
        "bos_token": "<s>", "eos_token": "<s>", "unk_token": "<s>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE}))
    return load_tokenizer(directory)
