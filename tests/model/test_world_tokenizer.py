"""RWKV's world tokenizer, read natively (model/world_tokenizer.py) from a vocabulary built locally in the
layout fla-hub's RWKV-7 checkpoints carry: greedy longest match over UTF-8 bytes, exact round trips, incremental
detokenisation at every split, <s> as id 0, and the checkpoint's own tokenizer code never run."""

from __future__ import annotations

import pytest

from linserve.model.world_tokenizer import ByteTrie, WorldTokenizer, read_vocabulary
from linserve.server.engine.detokenize import IncrementalDetokenizer
from tests.model.families.world_style import make_tokenizer

TEXT = "Now is the winter — café, naïve 日本語 🙂 of our discontent\n\nmade glorious"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("world"))


def test_the_world_layout_loads_natively_without_the_checkpoints_code(tokenizer):
    assert isinstance(tokenizer, WorldTokenizer)  # (its hf_rwkv_tokenizer.py raises if imported)
    assert len(tokenizer) == 1024 and tokenizer.bos_token_id == tokenizer.eos_token_id == 0
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode("hello", add_special_tokens=False)


def test_encoding_takes_the_longest_token_at_each_position():
    trie = ByteTrie({1: b"a", 2: b"b", 3: b"ab", 4: b"abc", 5: b"c", 6: b"bcd", 7: b"d"})
    assert trie.encode(b"abcd") == [4, 7]  # "abc" then "d": greedy from the left, never the better split "a","bcd"
    assert trie.encode(b"abab") == [3, 3]
    with pytest.raises(ValueError, match="no token"):
        trie.encode(b"x")


def test_text_round_trips_and_multi_byte_tokens_are_used(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(ids)) == ids
    pieces = [tokenizer.token_bytes()[i] for i in ids]
    assert "\n\n".encode() in pieces and "日本".encode() in pieces and b"".join(pieces) == TEXT.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # 🙂 arrives as single bytes


def test_incremental_detokenisation_is_exact_at_every_split(tokenizer):
    ids = tokenizer.encode(TEXT)
    for split in range(0, len(ids)):
        if tokenizer.decode(ids[:split]).endswith("\ufffd"):
            continue  # a split inside a character: no prompt ends there
        stream = IncrementalDetokenizer(tokenizer, context=ids[:split])
        assert "".join(stream.add(i) for i in ids[split:]) == TEXT[len(tokenizer.decode(ids[:split])):], split


def test_saving_and_loading_gives_the_same_vocabulary(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    again = WorldTokenizer.from_pretrained(str(tmp_path))
    assert again.encode(TEXT) == tokenizer.encode(TEXT) and again.token_bytes() == tokenizer.token_bytes()


def test_a_malformed_vocabulary_line_is_named(tmp_path):
    path = tmp_path / "rwkv_vocab_v20230424.txt"
    path.write_text("1 'a' 1\n2 'bc' 3\n")
    with pytest.raises(ValueError, match=":2: not `id literal length`"):
        read_vocabulary(str(path))
