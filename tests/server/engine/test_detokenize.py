"""Incremental detokenization and stop strings."""

from __future__ import annotations

import codecs

from linserve.server.engine.detokenize import IncrementalDetokenizer, StopMatcher

SAMPLES = ["ROMEO. But soft, what light", "emoji 😀👩‍👩‍👧 and 日本語", "tabs\tand\nnewlines  "]


def test_deltas_concatenate_to_the_full_decode(hf_tokenizer):
    for text in SAMPLES:
        ids = hf_tokenizer.encode(text)
        detok = IncrementalDetokenizer(hf_tokenizer)
        assert "".join(detok.add(i) for i in ids) == text


def test_each_step_decodes_a_bounded_window(hf_tokenizer):
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return hf_tokenizer.decode(ids)

    detok = IncrementalDetokenizer(Counting())
    for i in hf_tokenizer.encode("word " * 300):
        detok.add(i)
    assert max(calls) <= 8  # never the whole sequence


def test_skipped_ids_produce_no_text(hf_tokenizer):
    detok = IncrementalDetokenizer(hf_tokenizer, skip_ids=frozenset({0}))
    assert detok.add(0) == ""


def test_stop_string_split_across_pushes_is_withheld_then_cut():
    matcher = StopMatcher(("STOP",))
    out = []
    for piece in ["hello S", "TO", "P after"]:
        text, hit = matcher.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "hello " and hit


def test_false_alarm_is_released():
    matcher = StopMatcher(("STOP",))
    first, _ = matcher.push("abc ST")
    second, hit = matcher.push("ART")
    assert not hit and first + second + matcher.flush() == "abc START"


def test_earliest_of_several_stops_wins():
    text, hit = StopMatcher(("b", "a")).push("xxabxx")
    assert hit and text == "xx"


def test_the_window_stays_bounded_even_for_bytes_that_never_form_text(hf_tokenizer):
    from linserve.server.engine.detokenize import CONTEXT_TOKENS, MAX_HELD_TOKENS, IncrementalDetokenizer

    decoder = hf_tokenizer.backend_tokenizer
    lone_byte = next(i for i in range(len(hf_tokenizer)) if decoder.decode([i]) == "\ufffd")
    detok = IncrementalDetokenizer(decoder)
    text = "".join(detok.add(lone_byte) for _ in range(200))
    assert text and set(text) == {"\ufffd"}  # emitted, not held forever
    assert len(detok.ids) <= CONTEXT_TOKENS + MAX_HELD_TOKENS


def test_a_byte_level_tokenizer_detokenizes_from_its_table_as_it_decodes(hf_tokenizer):
    """The shipped (byte-level BPE) tokenizer gets a table of each token's bytes; its deltas — characters split
    across tokens, malformed bytes, skipped ids — concatenate to exactly what the tokenizer decodes (for
    well-formed text, what the two-decode path emits)."""
    import random

    from linserve.server.engine.detokenize import ByteLevelDecoder

    backend = hf_tokenizer.backend_tokenizer
    table = ByteLevelDecoder.of(backend)
    assert table is not None and len(table.table) == backend.get_vocab_size(with_added_tokens=True)
    generator = random.Random(7)
    cases = [hf_tokenizer.encode(text) for text in SAMPLES]
    cases += [[generator.randrange(backend.get_vocab_size()) for _ in range(200)] for _ in range(20)]  # any bytes
    for n, ids in enumerate(cases):
        fast = IncrementalDetokenizer(table, skip_ids=frozenset({0}))
        assert fast.table is not None
        deltas = [fast.add(i) for i in ids]
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # token by token, what Python's own decoder gives
        assert deltas == [utf8.decode(table.table[i]) if i != 0 else "" for i in ids]
        text = "".join(deltas)
        whole = backend.decode([i for i in ids if i != 0])
        assert whole.startswith(text) and len(whole) - len(text) <= 1  # at most an unfinished character held
        if n < len(SAMPLES):  # well-formed text: the two-decode path's too (on malformed bytes it places a U+FFFD
            slow = IncrementalDetokenizer(backend, skip_ids=frozenset({0}))  # by its window, not where decode does)
            assert slow.table is None and text == "".join(slow.add(i) for i in ids) == whole
    emoji = hf_tokenizer.encode("😀")
    assert len(emoji) > 1  # one character over several tokens: held until its last byte
    fast = IncrementalDetokenizer(table)
    assert [fast.add(i) for i in emoji] == [""] * (len(emoji) - 1) + ["😀"]


def test_a_tokenizer_that_is_not_byte_level_keeps_decoding_through_itself():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from linserve.server.engine.detokenize import ByteLevelDecoder

    vocab = {"▁a": 0, "▁b": 1, "c": 2, "<unk>": 3}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert ByteLevelDecoder.of(tokenizer) is None
    assert ByteLevelDecoder.of(object()) is None  # a decoder without a tokenizers spec (a slow tokenizer)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.table is None and "".join(detok.add(i) for i in [0, 2, 1]) == tokenizer.decode([0, 2, 1])


def test_the_engine_detokenizes_the_shipped_tokenizer_from_its_table(make_engine):
    from linserve.server.engine.detokenize import ByteLevelDecoder

    assert isinstance(make_engine().decoder, ByteLevelDecoder)
