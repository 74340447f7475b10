"""RWKV's "world" tokenizer, natively: what fla-hub's RWKV-7 checkpoints (and BlinkDL's world models) tokenize
with, without running the checkpoint's own Python (`hf_rwkv_tokenizer.py`, which needs `trust_remote_code`).

The vocabulary is `rwkv_vocab_v20230424.txt`: one token per line, `id literal length` — the literal a Python
str or bytes literal, length its UTF-8 byte count. Id 0 is the special `<s>` (beginning and end of text; not in
the file). A text is encoded as its UTF-8 bytes, cut greedily: at each position the longest token that matches
there (a trie walk), so every byte string encodes (the 256 single bytes are tokens) and decoding is the
concatenation of the tokens' bytes. Tokens are exchanged with transformers as str of one char per byte (latin-1),
so nothing is lost when a token is part of a UTF-8 character.
"""

from __future__ import annotations

import ast
import os

from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILE = "rwkv_vocab_v20230424.txt"


def read_vocabulary(path: str) -> dict[int, bytes]:
    """id → the token's bytes, from the vocabulary file (ValueError naming the line for a malformed one)."""
    tokens: dict[int, bytes] = {}
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            try:
                head, rest = line.split(" ", 1)
                literal, length = rest.rsplit(" ", 1)
                value = ast.literal_eval(literal)
                data = value.encode("utf-8") if isinstance(value, str) else value
                if not isinstance(data, bytes) or len(data) != int(length) or not data:
                    raise ValueError("the literal's length disagrees")
                tokens[int(head)] = data
            except (ValueError, SyntaxError) as error:
                raise ValueError(f"{path}:{number}: not `id literal length` ({error})") from None
    return tokens


class ByteTrie:
    """Greedy longest match over bytes: node i's children in `children[i]` (byte → node), its token in `ids[i]`."""

    def __init__(self, tokens: dict[int, bytes]) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.ids: list[int | None] = [None]
        for index, data in tokens.items():
            node = 0
            for byte in data:
                nxt = self.children[node].get(byte)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[node][byte] = nxt
                    self.children.append({})
                    self.ids.append(None)
                node = nxt
            self.ids[node] = index

    def encode(self, data: bytes) -> list[int]:
        out, start, n = [], 0, len(data)
        while start < n:
            node, position, best, best_end = 0, start, None, start
            while position < n:
                node = self.children[node].get(data[position])
                if node is None:
                    break
                position += 1
                if self.ids[node] is not None:
                    best, best_end = self.ids[node], position
            if best is None:
                raise ValueError(f"byte {data[start]:#04x} has no token in the world vocabulary")
            out.append(best)
            start = best_end
        return out


def as_text(data: bytes) -> str:
    return data.decode("latin-1")  # one char per byte: lossless


class WorldTokenizer(PreTrainedTokenizer):
    """transformers' slow-tokenizer interface over the world vocabulary (encode, decode, chat templates, added
    tokens); `token_bytes()` for structured outputs' grammar engine."""

    vocab_files_names = {"vocab_file": VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "<s>", eos_token: str = "<s>", unk_token: str = "<s>",
                 add_bos_token: bool = False, **kwargs) -> None:
        self.vocab_file = vocab_file
        self.add_bos_token = add_bos_token
        self._tokens = read_vocabulary(vocab_file)
        if 0 in self._tokens:
            raise ValueError(f"{vocab_file}: id 0 is <s>, not a vocabulary entry")
        self._trie = ByteTrie(self._tokens)
        self._ids = {as_text(data): index for index, data in self._tokens.items()}
        kwargs.pop("added_tokens_decoder", None)  # id 0 is <s> whatever a saved config says
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         added_tokens_decoder={0: AddedToken(str(bos_token), special=True)}, **kwargs)

    @property
    def vocab_size(self) -> int:
        return max(self._tokens) + 1

    def get_vocab(self) -> dict[str, int]:
        return {**self._ids, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [as_text(self._tokens[i]) for i in self._trie.encode(text.encode("utf-8"))]

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str:
        return as_text(self._tokens[index]) if index in self._tokens else self.bos_token

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens).encode("latin-1").decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None):
        bos = [self.bos_token_id] if self.add_bos_token else []
        return bos + token_ids_0 + ([] if token_ids_1 is None else bos + token_ids_1)

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes (id 0: `<s>`'s text; ids the file skips: empty)."""
        return [self._tokens.get(i, str(self.bos_token).encode() if i == 0 else b"") for i in range(self.vocab_size)]

    def encode_bytes(self, data: bytes) -> list[int]:
        return self._trie.encode(data)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE)
        with open(path, "w", encoding="utf-8") as out:
            for index in sorted(self._tokens):
                data = self._tokens[index]
                try:
                    literal = repr(data.decode("utf-8"))
                except UnicodeDecodeError:
                    literal = repr(data)
                out.write(f"{index} {literal} {len(data)}\n")
        return (path,)
