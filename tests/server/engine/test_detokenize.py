"""Incremental detokenization and stop strings."""

from __future__ import annotations

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
