"""Speculative decoding in the engine (verify_program.py, speculation.py): the output equals
non-speculative decoding token for token — greedy and seeded sampling, penalties, sessions, n > 1, a mixed
batch — while drafts are really verified and accepted; slots balance after every test."""

from __future__ import annotations

import pytest

from linserve.server.engine.types import SamplingParams, Speculation
from tests.helpers import prompt, run, tokens_of

NGRAM = Speculation("ngram", 4)


def looping_prompt(n: int, period: int, seed: int) -> list[int]:
    """A prompt that repeats itself: prompt lookup drafts from it."""
    unit = prompt(period, seed)
    return (unit * (n // period + 1))[:n]


def generate(engine, prompt_ids, params, name):
    return tokens_of(run(engine, prompt_ids, params, name))


def drafted(engine) -> tuple[int, int]:
    return (sum(s.drafted for s in engine.test_stats if hasattr(s, "drafted")),
            sum(s.accepted for s in engine.test_stats if hasattr(s, "accepted")))


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=48, temperature=0),
    SamplingParams(max_tokens=48, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(max_tokens=48, temperature=0.8, seed=7),
    SamplingParams(max_tokens=48, temperature=1.0, seed=3, presence_penalty=0.4),
], ids=["greedy", "greedy-penalties", "sampled", "sampled-penalties"])
def test_speculative_output_equals_plain_decoding(make_engine, params):
    plain = make_engine()
    fast = make_engine(speculative="ngram")
    fast.speculation.always = True
    for i in range(4):
        ids = looping_prompt(40, 5 + i, seed=i)
        assert generate(fast, ids, params, f"s{i}") == generate(plain, ids, params, f"p{i}")
    tried, kept = drafted(fast)
    assert tried > 0, tried  # drafts were verified
    if params.greedy and not params.uses_penalties:  # the tiny model loops: its own drafts are accepted
        assert kept > 0, (tried, kept)


PARAMS = [SamplingParams(max_tokens=40, temperature=0),
          SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
          SamplingParams(max_tokens=40, temperature=0.9, seed=11, frequency_penalty=0.3)]


class OracleDrafter:
    """Drafts what plain decoding will emit (known from a plain run), every third draft wrong: exercises
    acceptance, rejection and the rollback on every step whatever the model."""

    expected: list[int] = []

    def __init__(self, context, eos_ids=frozenset(), **_):
        self.pushed = 0  # tokens generated after the first (which arrives in the context)

    def push(self, token):
        self.pushed += 1

    def propose(self, k):
        start = self.pushed + 1
        draft = self.expected[start : start + k]
        return [t if (start + i) % 3 else (t + 1) % 1000 + 1 for i, t in enumerate(draft)]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "greedy-penalties", "sampled-penalties"])
def test_drafts_of_the_true_continuation_are_accepted_and_wrong_ones_rolled_back(make_engine, monkeypatch, params):
    from linserve.server.engine.spec import speculation

    plain = make_engine()
    ids = prompt(30, seed=5)
    OracleDrafter.expected = generate(plain, ids, params, "plain")
    monkeypatch.setattr(speculation, "NgramDrafter", OracleDrafter)
    fast = make_engine(speculative="ngram", speculative_k=4)  # (every third wrong: ≥ 1 of 4 drafts kept a step)
    fast.speculation.always = True
    assert generate(fast, ids, params, "fast") == OracleDrafter.expected
    tried, kept = drafted(fast)
    assert kept >= 0.4 * tried and kept < tried, (tried, kept)  # right drafts kept, wrong ones refused


def test_a_batch_of_speculating_and_plain_rows_gives_each_its_own_tokens(make_engine):
    """Invariant 3 with speculation: rows that verify drafts, rows that cannot (logprobs, filters) and rows
    that did not ask share verification steps; each gets the tokens it gets alone without speculation."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [(looping_prompt(24, 4, 1), SamplingParams(max_tokens=32, temperature=0, speculative=NGRAM)),
             (looping_prompt(24, 6, 2), SamplingParams(max_tokens=32, temperature=0.7, seed=5, speculative=NGRAM)),
             (looping_prompt(24, 5, 3), SamplingParams(max_tokens=32, temperature=0, logprobs=2, speculative=NGRAM)),
             (looping_prompt(24, 3, 4), SamplingParams(max_tokens=32, temperature=0.9, top_p=0.8, seed=2,
                                                      speculative=NGRAM)),
             (looping_prompt(24, 4, 5), SamplingParams(max_tokens=32, temperature=0)),
             (looping_prompt(24, 4, 6), SamplingParams(max_tokens=32, temperature=0, n=2, speculative=NGRAM))]
    plain = make_engine()
    alone = [[tokens_of(run(plain, ids, p, f"a{i}"), index) for index in range(p.n)]
             for i, (ids, p) in enumerate(cases)]
    fast = make_engine()
    fast.speculation.always = True
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(lambda c: run(fast, c[1][0], c[1][1], f"b{c[0]}"), enumerate(cases)))
    together = [[tokens_of(outputs, index) for index in range(p.n)] for outputs, (_, p) in zip(runs, cases)]
    assert together == alone
    assert drafted(fast)[0] > 0


def test_a_session_continued_with_speculation_equals_one_long_request(make_engine):
    """Invariant 2: turns of a session, speculating, give the tokens of one request over the whole text;
    the state after each turn is rolled back to exactly its last token."""
    params = SamplingParams(max_tokens=20, temperature=0, speculative=NGRAM)
    engine = make_engine()
    engine.speculation.always = True
    first, second = looping_prompt(20, 4, 7), looping_prompt(12, 3, 8)
    session = engine.sessions.create(None).result(10)
    turn1 = tokens_of(run(engine, first, params, "t1", session_id=session.id))
    turn2 = tokens_of(run(engine, second, params, "t2", session_id=session.id))
    reference = make_engine()
    whole = tokens_of(run(reference, first + turn1 + second,
                          SamplingParams(max_tokens=20, temperature=0), "whole"))
    assert turn2 == whole
    assert drafted(engine)[1] > 0


def test_max_tokens_and_stop_strings_end_inside_the_drafts(make_engine, hf_tokenizer):
    """Drafts never run past max_tokens; a stateless row that stops inside accepted drafts drops the rest."""
    engine = make_engine()
    engine.speculation.always = True
    plain = make_engine()
    ids = looping_prompt(24, 4, 1)
    for max_tokens in (1, 2, 3, 5, 9):
        p = SamplingParams(max_tokens=max_tokens, temperature=0)
        spec = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=NGRAM)
        fast = run(engine, ids, spec, f"m{max_tokens}")
        assert tokens_of(fast) == tokens_of(run(plain, ids, p, f"p{max_tokens}"))
        assert len(tokens_of(fast)) == max_tokens
    full = tokens_of(run(plain, ids, SamplingParams(max_tokens=24, temperature=0), "full"))
    stop = hf_tokenizer.decode(full[5:7])
    spec = SamplingParams(max_tokens=24, temperature=0, stop=(stop,), speculative=NGRAM)
    outputs = run(engine, ids, spec, "stop")
    reference = run(plain, ids, SamplingParams(max_tokens=24, temperature=0, stop=(stop,)), "stop-plain")
    assert "".join(o.text for o in outputs) == "".join(o.text for o in reference)
    assert outputs[-1].finish_reason == reference[-1].finish_reason


DRAFT = Speculation("draft", 4)


def test_a_draft_model_equal_to_the_served_one_has_every_greedy_draft_accepted(make_engine, tiny_model):
    """The draft model drafts with its own state per slot, rolled back after each verification: a draft model
    identical to the served one proposes exactly what greedy decoding emits, so every draft is accepted."""
    import copy

    plain = make_engine()
    fast = make_engine(draft_model=copy.deepcopy(tiny_model))
    fast.speculation.always = True
    params = SamplingParams(max_tokens=37, temperature=0, speculative=DRAFT)
    for i in range(3):
        ids = prompt(20 + 7 * i, seed=i)
        assert generate(fast, ids, params, f"d{i}") == generate(plain, ids, SamplingParams(max_tokens=37,
                                                                                           temperature=0), f"p{i}")
    tried, kept = drafted(fast)
    assert tried > 0 and kept == tried, (tried, kept)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=30, temperature=0, speculative=DRAFT),
    SamplingParams(max_tokens=30, temperature=0.8, seed=4, frequency_penalty=0.2, speculative=DRAFT),
], ids=["greedy", "sampled"])
def test_another_draft_model_changes_nothing_but_the_speed(make_engine, params):
    """A different (random) draft model: its drafts are mostly refused, the output is plain decoding's —
    also for a session continued over turns and for requests sharing the batch."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from linserve.model import LinearGPT
    from tests.helpers import TINY

    torch.manual_seed(123)
    other = LinearGPT(TINY).eval()
    plain = make_engine()
    fast = make_engine(draft_model=other.to(plain.device))
    fast.speculation.always = True
    ids = [prompt(25, seed=10 + i) for i in range(3)]
    plain_params = SamplingParams(**{**params.__dict__, "speculative": None})
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda x: generate(fast, x[1], params, f"f{x[0]}"), enumerate(ids)))
    assert got == [generate(plain, x, plain_params, f"p{i}") for i, x in enumerate(ids)]
    session = fast.sessions.create(None).result(10)
    turn1 = tokens_of(run(fast, ids[0], params, "t1", session_id=session.id))
    turn2 = tokens_of(run(fast, ids[1], params, "t2", session_id=session.id))
    assert turn1 == got[0]
    assert turn2 == generate(plain, ids[0] + turn1 + ids[1], plain_params, "whole")
    assert drafted(fast)[0] > 0


def test_draft_without_a_draft_model_is_refused(make_engine):
    from linserve.server.engine.types import EngineError, EngineRequest
    from tests.helpers import Collector

    engine = make_engine()
    with pytest.raises(EngineError, match="draft model") as refused:
        engine.submit(EngineRequest("x", prompt(5), SamplingParams(max_tokens=3, speculative=DRAFT)),
                      Collector()).result(10)
    assert refused.value.param == "speculative"


class FixedDrafter(OracleDrafter):
    """Drafts the same tokens every step (mostly refused): every step verifies and rolls back."""

    def propose(self, k):
        return [5, 6, 7, 8][:k]


def test_fork_rewind_export_and_import_with_speculation_on(make_engine, monkeypatch):
    """Invariant 2 with speculation forced on (sampled, penalised, seeded): a fork, a rewound session and an
    exported-then-imported one continue exactly as the session they copy, and as an engine without speculation."""
    from linserve.server.engine.spec import speculation

    monkeypatch.setattr(speculation, "NgramDrafter", FixedDrafter)
    spec = SamplingParams(max_tokens=12, temperature=0.9, seed=4, repetition_penalty=1.3, speculative=NGRAM)
    plain_params = SamplingParams(max_tokens=12, temperature=0.9, seed=4, repetition_penalty=1.3)

    def history(engine, params):
        session = engine.sessions.create(None).result(10)
        turns = [tokens_of(run(engine, looping_prompt(16, 4, 3), params, f"{id(params)}a",
                               session_id=session.id))]
        turns.append(tokens_of(run(engine, [5, 6, 7], params, f"{id(params)}b", session_id=session.id)))
        return session, turns

    fast = make_engine()
    fast.speculation.always = True
    plain = make_engine()
    session, turns = history(fast, spec)
    reference, plain_turns = history(plain, plain_params)
    assert turns == plain_turns
    fork = fast.sessions.fork(session.id, None).result(10)
    copy = fast.sessions.import_(fast.sessions.export(session.id, None).result(10), None).result(10)
    want = tokens_of(run(plain, [9, 9, 9], plain_params, "ref", session_id=reference.id))
    for i, target in enumerate((session.id, fork.id, copy.id)):
        assert tokens_of(run(fast, [9, 9, 9], spec, f"c{i}", session_id=target)) == want
    fast.sessions.rewind(session.id, None, 1).result(10)  # back to after the first turn
    plain.sessions.rewind(reference.id, None, 1).result(10)
    assert (tokens_of(run(fast, [5, 6, 7], spec, "r", session_id=session.id))
            == tokens_of(run(plain, [5, 6, 7], plain_params, "rr", session_id=reference.id)) == turns[1])
    assert drafted(fast)[0] > 0


def test_a_verification_step_that_fails_leaves_the_session_consistent(make_engine, monkeypatch):
    """The step fails after the verification program wrote the rows' states and counts (delivering raises, on a
    step that accepted drafts): the rows go back to the state the program read, their next tokens still pending
    — the turn fails, and continuing the session equals the transcript that was emitted."""
    from linserve.server.engine.step_runner import StepRunner
    from linserve.server.engine.types import EngineRequest, FinishReason
    from tests.helpers import Collector

    engine = make_engine(speculative="ngram")
    engine.speculation.always = True
    real, fired = StepRunner.deliver, []

    def deliver(self, rows, sampled, accepted=None):
        if accepted is not None and not fired and any(accepted) and \
                any(row.live.request.request_id == "s1" and row.num_generated >= 4 for row in rows):
            fired.append(sum(map(len, accepted)))
            raise RuntimeError("injected delivery fault")
        return real(self, rows, sampled, accepted)

    monkeypatch.setattr(StepRunner, "deliver", deliver)
    session = engine.sessions.create(None).result(10)
    head = looping_prompt(24, 6, seed=1)
    run(engine, head, SamplingParams(max_tokens=0), "s0", session_id=session.id)
    sink = Collector()
    turn = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    engine.submit(EngineRequest("s1", [7, 8], turn, session_id=session.id), sink).result(10)
    outputs = sink.wait()
    assert fired and fired[0] > 0 and outputs[-1].finish_reason is FinishReason.ERROR
    emitted = tokens_of(outputs)
    assert 4 <= len(emitted) < 60
    assert engine.sessions.info(session.id, None).result(10).tokens == len(head) + 2 + len(emitted)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, repetition_penalty=3.0)
    continued = tokens_of(run(engine, [5], sampled, "s2", session_id=session.id))
    assert continued == tokens_of(run(engine, head + [7, 8] + emitted + [5], sampled, "reference"))


def test_a_step_that_also_prefills_does_not_speculate(make_engine):
    """While a prompt is prefilled beside decoding rows, those rows take plain decode steps (a longer
    verification step would delay that prompt's first token); before and after, they verify drafts."""
    from linserve.server.engine.types import EngineRequest
    from tests.helpers import Collector

    engine = make_engine(speculative="ngram")
    engine.speculation.always = True
    sinks = [Collector(), Collector()]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    engine.submit(EngineRequest("decoding", looping_prompt(24, 6, seed=1), params), sinks[0]).result(10)
    engine.submit(EngineRequest("long-prompt", prompt(400, seed=2), SamplingParams(max_tokens=4)), sinks[1]).result(10)
    for sink in sinks:
        sink.wait(1, timeout=120)
    steps = [s for s in engine.test_stats if hasattr(s, "phase")]
    mixed = [s for s in steps if s.phase == "mixed"]
    assert len(mixed) >= 10  # 400 prompt tokens, 16 a step while a row decodes
    assert all(s.drafted == 0 for s in mixed), [s.drafted for s in mixed]
    assert sum(s.drafted for s in steps if s.phase == "decode") > 0


def test_decode_steps_are_timed_for_the_policy_only_while_a_request_speculates(make_engine):
    """A server that may speculate (a request can ask) spends nothing on the policy while no request does: its
    decode steps are neither planned nor timed; a request that asks gets them timed (the cost verification is
    weighed against), and its output is the plain one."""
    engine = make_engine()  # (the server's default: off — a request's `speculative` turns it on)
    ids = looping_prompt(24, 6, seed=1)
    plain = generate(engine, ids, SamplingParams(max_tokens=24, temperature=0), "plain")
    assert engine.speculation is not None and engine.speculation.costs == {}
    asked = SamplingParams(max_tokens=24, temperature=0, speculative=Speculation("ngram"))
    assert generate(engine, ids, asked, "asked") == plain
    assert any(kind == "decode" for kind, *_ in engine.speculation.costs), engine.speculation.costs
