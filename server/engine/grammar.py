"""Structured outputs' grammars as requests ask for them (JSON schema, JSON object, regex, choice, Lark or GBNF),
compiled to llguidance's serialized form and checked against the tokenizer — torch-free: a frontend process
compiles each request's grammar (a bad one is its 400) and the engine core builds the token masks from the source
(constraint.py)."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHED_GRAMMARS = 256  # compiled grammars kept (by what was asked), least recently used dropped
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no tokens spent on layout


@dataclass(frozen=True)
class Grammar:
    """A compiled-on-demand grammar in llguidance's serialized form (what SamplingParams carries)."""

    source: str  # llguidance grammar (from grammar_from_json_schema / _regex / _lark)
    description: str  # what the client asked for, for errors and logs
    finite_numbers: bool = False  # JSON: every number bounded to a finite double (json_numbers.py)


class ByteVocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer that is not a Rust one: every id's bytes, the
    special ids, and encoding bytes to ids."""

    def __init__(self, tokenizer) -> None:
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids))
        self._encode = tokenizer.encode_bytes

    def __call__(self, data: bytes) -> list[int]:
        return self._encode(data)


class GrammarCompiler:
    """The tokenizer's view for llguidance, and the grammars compiled against it (cached by what was asked)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.eos_id = tokenizer.eos_token_id
        if hasattr(tokenizer, "token_bytes"):  # a slow tokenizer that knows its tokens' bytes (RWKV's world)
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteVocabulary(tokenizer)),
                                                    n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
        else:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile(self, kind: str, value) -> Grammar:
        """The grammar for what a request asked (`kind` in KINDS), checked against this tokenizer: an invalid or
        unsupported one raises ValueError naming what is wrong. Cached by what was asked."""
        key = (kind, value if isinstance(value, str) else json.dumps(value, sort_keys=True))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = Grammar(self._source(kind, value), f"{kind} {key[1][:200]}",
                              finite_numbers=kind in ("json_schema", "json_object"))
        except Exception as error:  # noqa: BLE001 - the library's complaint about the client's grammar
            raise ValueError(str(error) or type(error).__name__) from None
        error, messages = self._llguidance.LLMatcher.validate_grammar_with_warnings(grammar.source, self.tokenizer)
        if error:
            raise ValueError("; ".join(messages) or "the grammar is invalid")
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return grammar

    def _source(self, kind: str, value) -> str:
        matcher = self._llguidance.LLMatcher
        if kind == "json_schema":
            if not isinstance(value, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            return matcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return matcher.grammar_from_regex(value)
        if kind == "choice":
            return matcher.grammar_from_regex("|".join(f"(?:{re.escape(choice)})" for choice in value))
        if kind == "grammar":  # Lark, or GBNF (llama.cpp's, `::=`) translated to Lark
            from llguidance.gbnf_to_lark import any_to_lark

            return matcher.grammar_from_lark(any_to_lark(value))
        raise ValueError(f"unknown kind of constraint {kind!r}")
