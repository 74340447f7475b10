"""Constrained decoding in the engine (engine/constraint.py) with the real tokenizer and grammar engine: the
mask reaches the decode program as the row's bias, the budget closes the structure, rows of a batch keep their
own grammars (or none), n > 1 rows each follow theirs, and slots balance (invariant 5)."""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import jsonschema
import pytest
import torch

from linserve.server.engine import SamplingParams
from linserve.server.engine.constraint import GrammarConstraint, GrammarRuntime
from tests.helpers import assert_slots_balance, prompt, run

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
          "required": ["name", "n", "tags"]}


@pytest.fixture(scope="module")
def runtime(hf_tokenizer):
    return GrammarRuntime(hf_tokenizer, len(hf_tokenizer))


def text_of(engine, outputs) -> str:
    return "".join(o.text for o in outputs)


def test_compiled_grammars_are_cached_and_bad_ones_name_the_problem(runtime):
    assert runtime.compile("json_schema", SCHEMA) is runtime.compile("json_schema", json.loads(json.dumps(SCHEMA)))
    for kind, value, words in [("json_schema", {"type": "strng"}, "strng"), ("regex", "[a-", "."),
                               ("grammar", "start: nowhere", "nowhere"), ("json_schema", [1], "object")]:
        with pytest.raises(ValueError, match=words):
            runtime.compile(kind, value)


def test_the_bias_row_allows_exactly_what_the_grammar_does(runtime, hf_tokenizer):
    grammar = runtime.compile("choice", ["yes", "no"])
    base = torch.zeros(len(hf_tokenizer))
    base[5] = 2.5  # the request's own logit_bias stays on allowed tokens
    constraint = GrammarConstraint(runtime, grammar, base)
    row = torch.zeros(len(hf_tokenizer))
    constraint.write(row, remaining=50)
    allowed = torch.isfinite(row).nonzero()[:, 0].tolist()
    texts = {hf_tokenizer.decode([t]) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert row[torch.isfinite(row)].eq(0).all()  # token 5 is not allowed here: its bias is -inf, not 2.5


def test_the_budget_closes_an_open_string(runtime, hf_tokenizer):
    constraint = GrammarConstraint(runtime, runtime.compile("json_schema", SCHEMA), torch.zeros(len(hf_tokenizer)))
    for token in hf_tokenizer.encode('{"name":"so long a', add_special_tokens=False):
        constraint.accept(token)
    way = constraint._closing_way(80)
    tail = hf_tokenizer.decode([t for t in way if t != hf_tokenizer.eos_token_id])
    jsonschema.validate(json.loads('{"name":"so long a' + tail), SCHEMA)
    assert way[-1] == hf_tokenizer.eos_token_id
    row = torch.zeros(len(hf_tokenizer))
    constraint.write(row, remaining=len(way))  # exactly enough left: only the way's next token
    assert torch.isfinite(row).nonzero()[:, 0].tolist() == [way[0]]


def test_where_it_could_end_it_ends_unless_going_on_still_fits(runtime, hf_tokenizer):
    """At an accepting point a new item is begun only with room to finish it: going on can need far more than
    closing needed a token before (a second tool call after a complete first)."""
    grammar = runtime.compile("regex", "(<item [a-z]{3} [0-9]{4} done>)+")
    constraint = GrammarConstraint(runtime, grammar, torch.zeros(len(hf_tokenizer)))
    for token in hf_tokenizer.encode("<item abc 1234 done>", add_special_tokens=False):
        constraint.accept(token)
    going_on = constraint._closing_way(64, go_on=True)
    assert going_on[0] != hf_tokenizer.eos_token_id and len(going_on) > 2  # another whole item
    row = torch.zeros(len(hf_tokenizer))
    constraint.write(row, remaining=len(going_on) + 2)  # too little room to go on: end-of-text only
    assert torch.isfinite(row).nonzero()[:, 0].tolist() == [hf_tokenizer.eos_token_id]
    roomy = GrammarConstraint(runtime, grammar, torch.zeros(len(hf_tokenizer)))
    for token in hf_tokenizer.encode("<item abc 1234 done>", add_special_tokens=False):
        roomy.accept(token)
    roomy.write(row, remaining=60)  # room enough: another item may begin
    assert torch.isfinite(row).sum() > 1


def test_constrained_and_free_rows_share_batches_and_slots_balance(make_engine, runtime):
    engine = make_engine(num_slots=16)
    grammar = engine.grammars.compile("json_schema", SCHEMA)
    constrained = SamplingParams(max_tokens=60, temperature=1.0, seed=3, grammar=grammar, n=2)
    free = SamplingParams(max_tokens=60, temperature=1.0, seed=3, ignore_eos=True)
    results, threads = {}, []

    def one(name, params):
        results[name] = run(engine, prompt(8, 5), params, name)

    for name, params in [("c1", constrained), ("f1", free), ("c2", dataclasses.replace(constrained, seed=9)),
                         ("f2", free)]:
        threads.append(threading.Thread(target=one, args=(name, params)))
        threads[-1].start()
    for thread in threads:
        thread.join(60)
    for name in ("c1", "c2"):
        for row in range(2):
            outputs = [o for o in results[name] if o.index == row]
            assert outputs[-1].finish_reason.value == "stop"
            jsonschema.validate(json.loads(text_of(engine, outputs)), SCHEMA)
    alone = run(engine, prompt(8, 5), free, "f3")  # invariant 3: a free row is untouched by its neighbours
    assert text_of(engine, alone) == text_of(engine, [o for o in results["f1"] if o.index == 0])
    assert_slots_balance(engine)


def test_a_session_turn_is_constrained_too(make_engine):
    engine = make_engine(num_slots=8, session_store="none")
    session = engine.sessions.create(None).result(10)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                            grammar=engine.grammars.compile("regex", "[A-Z]{3}-[0-9]{2}"))
    outputs = run(engine, prompt(4, 2), params, "s1", session_id=session.id)
    assert outputs[-1].finish_reason.value == "stop" and len(text_of(engine, outputs)) == 6
    assert_slots_balance(engine)

def test_a_grammar_s_end_is_final_even_when_the_request_ignores_end_of_text(make_engine):
    """`ignore_eos` lets a free row run past end-of-text; a constrained row's end-of-text is its grammar's end (the
    row reads this from its own copy of the request's constants: both kinds in one batch)."""
    engine = make_engine(num_slots=4)
    grammar = engine.grammars.compile("regex", "[A-Z]{3}-[0-9]{2}")
    eos = engine.tokenizer.eos_token_id
    constrained = SamplingParams(max_tokens=40, temperature=1.0, seed=4, grammar=grammar, ignore_eos=True)
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=4, ignore_eos=True, logit_bias=((eos, 100.0),))
    results = {}
    threads = [threading.Thread(target=lambda name=name, params=params: results.setdefault(
        name, run(engine, prompt(6, 3), params, name))) for name, params in [("c", constrained), ("f", free)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results["c"][-1].finish_reason.value == "stop" and results["c"][-1].end_of_text
    assert len(text_of(engine, results["c"])) == 6
    assert results["f"][-1].finish_reason.value == "length" and len(results["f"]) == 30  # every token end-of-text
    assert all(o.end_of_text for o in results["f"])
    assert_slots_balance(engine)



def test_json_numbers_stay_finite_doubles_however_hard_the_model_pushes(make_engine, hf_tokenizer):
    """Digits and exponent markers favoured by +40: unbounded, the number grows until the budget closes it (an
    integer part of ~100 digits, an exponent of dozens); bounded, it reads as a finite double."""
    engine = make_engine(num_slots=4)
    schema = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "integer"}},
              "required": ["x", "y"], "additionalProperties": False}
    pushed = [t for t in range(len(hf_tokenizer)) if hf_tokenizer.decode([t]) in ("1", "9", "99", "E", "e", "e+")]
    assert len(pushed) >= 4
    for grammar in (engine.grammars.compile("json_schema", schema), engine.grammars.compile("json_object", None)):
        params = SamplingParams(max_tokens=120, temperature=0, grammar=grammar,
                                logit_bias=tuple((t, 40.0) for t in pushed))
        outputs = run(engine, prompt(6, 1), params, f"n{grammar.description[:9]}")
        text = text_of(engine, outputs)
        numbers: list[str] = []
        json.loads(text, parse_float=lambda s, seen=numbers: seen.append(s) or float(s),
                   parse_int=lambda s, seen=numbers: seen.append(s) or int(s))
        assert all(math.isfinite(float(n)) for n in numbers), text
        if grammar.description.startswith("json_schema"):  # (there the push reaches a bound: x and y are numbers)
            assert len(numbers) == 2 and any("e" in n.lower() or len(n) >= 19 for n in numbers), text
    assert_slots_balance(engine)


@pytest.mark.parametrize("text,finite", [
    ('{"a":1e288}', True), ('{"a":1e289}', False), ('{"a":-12.5E-288,"b":[3]}', True), ('{"a":1e0288}', False),
    ('[' + "9" * 19 + ']', True), ('[' + "9" * 20 + ']', False), ('["1e999999", 2]', True), ('{"k\\"1e999":1}', True),
    ('[1.' + "9" * 50 + 'e+2]', True)])
def test_the_number_lexer_bounds_integer_digits_and_exponents(text, finite):
    from linserve.server.engine.json_numbers import START, lex

    assert (lex(START, text) is not None) == finite
    state = START  # character by character (as tokens arrive): the same verdict
    for char in text:
        state = lex(state, char) if state is not None else None
    assert (state is not None) == finite


def test_the_tables_agree_with_the_lexer_for_every_token_and_state(hf_tokenizer):
    from linserve.server.engine.json_numbers import EXP, INT, START, NumberTables, lex

    texts = [hf_tokenizer.decode([t]) for t in range(len(hf_tokenizer))]
    tables = NumberTables(texts)
    for prefix in ('{"a":', '{"a":12345678901234567', '{"a":1e2', '{"a":1e28', '{"a":1.5', '{"a":1e', '{"a":"x\\',
                   '{"a":-', '{"a":' + "9" * 19):
        state = lex(START, prefix)
        allowed = tables.allowed(state)
        expected = torch.tensor([lex(state, t) is not None for t in texts])
        assert torch.equal(allowed if allowed is not None else torch.ones(len(texts), dtype=torch.bool), expected), (
            prefix, state)
        if prefix in ('{"a":1e28', '{"a":' + "9" * 19):  # near a bound: some digits are forbidden
            assert state[0] in (INT, EXP) and not bool(expected.all())
