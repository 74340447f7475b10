"""Sessions of constant size: penalties, detokenizer context and turns survive without a transcript."""

from __future__ import annotations

import pytest

from linserve.server.engine import EngineError, SamplingParams
from tests.helpers import prompt, run, tokens_of

GREEDY_10 = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PENALISED = SamplingParams(max_tokens=10, temperature=0.9, seed=4, repetition_penalty=1.8, ignore_eos=True)



def session_bytes(engine, session_id: str) -> int:
    """Host bytes of everything a session keeps besides its slot's state and its turn snapshots."""
    def measure() -> int:
        session = engine.registry.by_id[session_id]
        tensors = [t for t in (session.logits, session.seen) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + 8 * (len(session.pending) + len(session.tail))
    return engine.commands.call(measure).result(10)


def test_penalties_see_the_whole_history_after_export_and_import(make_engine):
    """A greedy model loops over its favourite tokens; with a strong repetition penalty, a continuation
    must avoid every token of the history — including what came before an export/import."""
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    head = prompt(25, 1)
    loop = tokens_of(run(engine, head, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), "t1",
                         session_id=session.id))
    restored = engine.sessions.import_(engine.sessions.export(session.id, None).result(10), None).result(10)
    strict = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=10.0, ignore_eos=True)
    continued = tokens_of(run(engine, [], strict, "t2", session_id=restored.id))
    whole = tokens_of(run(engine, head + loop, strict, "whole"))
    assert continued == whole
    assert not set(continued[:1]) & set(loop)  # the penalty saw the history (the loop's tokens are avoided)
    assert tokens_of(run(engine, [], strict, "orig", session_id=session.id)) == whole


def test_a_session_does_not_grow_with_its_history(make_engine):
    engine = make_engine(session_turns_kept=2)
    session = engine.sessions.create(None).result(10)
    run(engine, prompt(10, 2), SamplingParams(max_tokens=5, temperature=0), "short", session_id=session.id)
    small = session_bytes(engine, session.id)
    for i in range(4):
        run(engine, prompt(200, 3 + i), SamplingParams(max_tokens=100, temperature=0.8, seed=i, ignore_eos=True),
            f"long{i}", session_id=session.id)
    assert engine.sessions.info(session.id, None).result(10).tokens > 1000
    assert session_bytes(engine, session.id) == small
    assert len(engine.sessions.turns(session.id, None).result(10)[0]) == 2


def test_rewind_equals_never_having_had_the_dropped_turns(make_engine):
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    head = prompt(20, 5)
    run(engine, head, SamplingParams(max_tokens=0), "t1", session_id=session.id)
    answer = tokens_of(run(engine, [7], PENALISED, "t2", session_id=session.id))
    run(engine, [8, 9], PENALISED, "t3", session_id=session.id)  # the turn to regenerate
    turns = engine.sessions.turns(session.id, None).result(10)[0]
    assert [t.index for t in turns] == [1, 2, 3]
    assert [t.tokens for t in turns][:2] == [20, 20 + 1 + len(answer)]
    info = engine.sessions.rewind(session.id, None, 2).result(10)
    assert info.tokens == 21 + len(answer)
    again = tokens_of(run(engine, [8, 9], PENALISED, "t3b", session_id=session.id))
    reference = engine.sessions.create(None).result(10)
    run(engine, head, SamplingParams(max_tokens=0), "r1", session_id=reference.id)
    run(engine, [7], PENALISED, "r2", session_id=reference.id)
    assert again == tokens_of(run(engine, [8, 9], PENALISED, "r3", session_id=reference.id))
    assert [t.index for t in engine.sessions.turns(session.id, None).result(10)[0]] == [1, 2, 3]
    with pytest.raises(EngineError) as error:
        engine.sessions.rewind(session.id, None, 9).result(10)
    assert error.value.param == "turn"


def test_rewind_works_from_the_host_tier(make_engine):
    engine = make_engine(num_slots=2, max_n=1, reserved_slots=1)
    a = engine.sessions.create(None).result(10)
    run(engine, prompt(12, 6), SamplingParams(max_tokens=0), "a1", session_id=a.id)
    expected = tokens_of(run(engine, [1], GREEDY_10, "a2", session_id=a.id))
    run(engine, [2], GREEDY_10, "a3", session_id=a.id)
    for i in range(2):  # push `a` to host memory
        other = engine.sessions.create(None).result(10)
        run(engine, prompt(5, 10 + i), SamplingParams(max_tokens=0), f"o{i}", session_id=other.id)
    assert engine.sessions.info(a.id, None).result(10).tier == "host"
    engine.sessions.rewind(a.id, None, 1).result(10)
    assert tokens_of(run(engine, [1], GREEDY_10, "a2b", session_id=a.id)) == expected


def test_each_session_keeps_its_own_turn_text_within_its_budget(make_engine, hf_tokenizer):
    engine = make_engine(session_text_chars=200)
    a, b = engine.sessions.create(None).result(10), engine.sessions.create(None).result(10)
    said = {}
    for sid, text in ((a.id, "ROMEO.\nBut soft"), (b.id, "JULIET.\nAy me")):
        outputs = run(engine, hf_tokenizer.encode(text), GREEDY_10, f"first-{sid}", session_id=sid)
        said[sid] = (text, "".join(o.text for o in outputs))
    for sid in (a.id, b.id):
        texts = engine.sessions.turns(sid, None).result(10)[1]
        assert [(t["turn"], t["prompt"], t["completion"]) for t in texts] == [(1, *said[sid])]
    for i in range(12):  # the budget drops the oldest turns' text first; it never grows past it
        run(engine, hf_tokenizer.encode(f" and then {i}"), GREEDY_10, f"more-{i}", session_id=a.id)
    texts = engine.sessions.turns(a.id, None).result(10)[1]
    assert sum(len(t["prompt"]) + len(t["completion"]) for t in texts) <= 200
    assert texts[-1]["turn"] == 13 and texts[-1]["prompt"] == " and then 11" and texts[0]["turn"] > 1
    engine.sessions.rewind(a.id, None, 12).result(10)
    assert engine.sessions.turns(a.id, None).result(10)[1][-1]["turn"] == 12
    fork = engine.sessions.fork(b.id, None).result(10)
    imported = engine.sessions.import_(engine.sessions.export(b.id, None).result(10), None).result(10)
    for copy in (fork.id, imported.id):  # B's text comes along as history before the copy's own turns
        assert [(t["turn"], t["prompt"]) for t in engine.sessions.turns(copy, None).result(10)[1]] == [
            (0, "JULIET.\nAy me")]
    silent = make_engine(session_text_chars=0)
    quiet = silent.sessions.create(None).result(10)
    run(silent, prompt(5, 1), GREEDY_10, "q", session_id=quiet.id)
    assert silent.sessions.turns(quiet.id, None).result(10)[1] == []
