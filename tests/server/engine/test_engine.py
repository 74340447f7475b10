"""The engine on a tiny random model with its real thread: equivalences, isolation, lifecycle."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from linserve.server.engine import EngineError, EngineRequest, FinishReason, SamplingParams
from tests.helpers import GREEDY, Collector, assert_slots_balance, prompt, run, tokens_of


def test_greedy_matches_the_model_loop(make_engine, tiny_model):
    engine = make_engine()
    assert all(b.device.type == engine.device.type and b.dtype == torch.float32  # (S, z) on the device, fp32
               for b in engine.pool.buffers.values())
    ids = prompt(37)
    got = tokens_of(run(engine, ids, GREEDY, "a"))
    logits, state = tiny_model(torch.tensor([ids], device=engine.device))
    expected = []
    for _ in range(12):
        token = int(logits[0, -1].argmax())
        expected.append(token)
        logits, state = tiny_model(torch.tensor([[token]], device=engine.device), state)
    assert got == expected


def test_session_continuation_equals_whole_transcript(make_engine):
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    first, second = prompt(21, 1), prompt(9, 2)
    run(engine, first, SamplingParams(max_tokens=0), "s0", session_id=session.id)
    generated = tokens_of(run(engine, [], GREEDY, "s1", session_id=session.id))
    continued = tokens_of(run(engine, second, GREEDY, "s2", session_id=session.id))
    whole = tokens_of(run(engine, first + generated + second, GREEDY, "w"))
    assert continued == whole
    info = engine.sessions.info(session.id, None).result(10)
    assert info.tokens == len(first) + len(generated) + len(second) + len(continued)


def test_seeded_sampling_continuation_equals_whole_transcript(make_engine):
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    head = prompt(30, 3)
    generated = tokens_of(run(engine, head, params, "s1", session_id=session.id))
    continued = tokens_of(run(engine, [5, 6, 7], params, "s2", session_id=session.id))
    whole = tokens_of(run(engine, head + generated + [5, 6, 7], params, "w"))
    assert continued == whole


def test_fork_continues_exactly_like_its_parent(make_engine):
    engine = make_engine()
    parent = engine.sessions.create(None).result(10)
    run(engine, prompt(40, 4), GREEDY, "p0", session_id=parent.id)
    child = engine.sessions.fork(parent.id, None).result(10)
    assert child.tokens == engine.sessions.info(parent.id, None).result(10).tokens
    a = tokens_of(run(engine, [9, 8, 7], GREEDY, "p1", session_id=parent.id))
    b = tokens_of(run(engine, [9, 8, 7], GREEDY, "c1", session_id=child.id))
    assert a == b


def test_snapshot_export_import_continues_identically(make_engine):
    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    run(engine, prompt(33, 5), GREEDY, "e0", session_id=session.id)
    data = engine.sessions.export(session.id, None).result(10)
    restored = engine.sessions.import_(data, None).result(10)
    assert restored.tokens == engine.sessions.info(session.id, None).result(10).tokens
    a = tokens_of(run(engine, [3, 4], GREEDY, "e1", session_id=session.id))
    b = tokens_of(run(engine, [3, 4], GREEDY, "e2", session_id=restored.id))
    assert a == b


def test_corrupt_and_foreign_snapshots_are_rejected(make_engine, tiny_model, hf_tokenizer, device):
    from linserve.model import LinearGPT

    engine = make_engine()
    session = engine.sessions.create(None).result(10)
    run(engine, prompt(10, 6), SamplingParams(max_tokens=0), "x0", session_id=session.id)
    data = engine.sessions.export(session.id, None).result(10)
    for bad, message in [(b"not safetensors", "not a safetensors"), (data[:-7], "not a safetensors"),
                         (data.replace(b'"version":"2"', b'"version":"9"'), "version")]:
        with pytest.raises(EngineError, match=message):
            engine.sessions.import_(bad, None).result(10)
    torch.manual_seed(1)
    foreign = make_engine(model=LinearGPT(tiny_model.config).to(device), num_slots=2)
    with pytest.raises(EngineError, match="different model"):
        foreign.sessions.import_(data, None).result(10)


def test_batch_invariance_greedy_alone_and_among_sixteen(make_engine):
    engine = make_engine()
    target = prompt(50, 7)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    alone = run(engine, target, params, "alone")
    sinks = [Collector() for _ in range(16)]
    for i, sink in enumerate(sinks):
        engine.submit(
            EngineRequest(
                f"other{i}", prompt(5 + 7 * i, 100 + i), SamplingParams(max_tokens=20, temperature=0.8, seed=i)
            ),
            sink,
        ).result(10)
    crowd = run(engine, target, params, "crowd")
    for sink in sinks:
        sink.wait()
    assert tokens_of(alone) == tokens_of(crowd)
    for a, b in zip(alone, crowd):
        if a.logprob is not None:
            assert abs(a.logprob.logprob - b.logprob.logprob) < 1e-4


def test_seeded_sampling_reproducible_across_batch_compositions(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=15, temperature=1.0, top_k=40, min_p=0.01, seed=1234, ignore_eos=True)
    alone = tokens_of(run(engine, prompt(20, 8), params, "alone"))
    noise = [Collector() for _ in range(6)]
    for i, sink in enumerate(noise):
        engine.submit(
            EngineRequest(f"n{i}", prompt(3 + i, 50 + i), SamplingParams(max_tokens=25, temperature=1.0)), sink
        )
    crowd = tokens_of(run(engine, prompt(20, 8), params, "crowd"))
    for sink in noise:
        sink.wait()
    assert alone == crowd


def test_n_samples_fork_the_prefilled_state(make_engine):
    engine = make_engine(prefix_cache_entries=0)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    outputs = run(engine, prompt(40, 9), params, "fan")
    rows = [tokens_of(outputs, i) for i in range(3)]
    assert all(len(r) == 8 for r in rows) and len({tuple(r) for r in rows}) > 1
    single = tokens_of(
        run(engine, prompt(40, 9), SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True), "one")
    )
    assert single == rows[1]  # row i samples with seed + i: same as a single request with that seed
    prefill_tokens = sum(s.prefill_tokens for s in engine.test_stats if hasattr(s, "prefill_tokens"))
    assert prefill_tokens == 80  # the prompt was prefilled once per request, never per row


def test_stop_strings_end_generation_and_are_withheld(make_engine, hf_tokenizer):
    engine = make_engine()
    params = dict(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    free = run(engine, prompt(12, 10), SamplingParams(**params), "free")
    text = "".join(o.text for o in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    stopped = run(engine, prompt(12, 10), SamplingParams(**params, stop=(stop, "never-seen")), "stop")
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert "".join(o.text for o in stopped) == text[: text.find(stop)]


def test_cancellation_frees_the_slot(make_engine):
    engine = make_engine(num_slots=2)
    sink = Collector()
    engine.submit(
        EngineRequest("long", prompt(10), SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)), sink
    ).result(10)
    sink.queue.get(timeout=10)
    engine.abort("long")
    outputs = sink.wait()
    assert outputs[-1].finish_reason is FinishReason.ABORT
    assert engine.counts().result(10) == (0, 0, 0)
    assert engine.pool.used_slots == 0


def test_thousand_short_requests_leave_nothing_behind(make_engine):
    engine = make_engine(num_slots=8, max_waiting=1000)
    threads_before = threading.active_count()
    sinks, accepted = [], []
    for i in range(1000):
        sink = Collector()
        accepted.append(
            engine.submit(
                EngineRequest(f"r{i}", prompt(3, i), SamplingParams(max_tokens=2, temperature=0.5, seed=i)), sink
            )
        )
        sinks.append(sink)
        if i % 7 == 0:
            engine.abort(f"r{i}")
    for future in accepted:
        future.result(30)
    for sink in sinks:
        assert sink.wait()[-1].finished
    assert engine.counts().result(10) == (0, 0, 0)
    assert engine.pool.used_slots == 0 and not engine.live and not engine.scheduler.waiting
    assert threading.active_count() == threads_before


def test_full_queue_rejects_with_capacity_error(make_engine):
    engine = make_engine(num_slots=1, max_waiting=2)
    futures = [
        engine.submit(
            EngineRequest(f"q{i}", [1, 2], SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)),
            Collector(),
        )
        for i in range(6)
    ]
    kinds = []
    for future in futures:
        try:
            future.result(10)
            kinds.append("ok")
        except EngineError as error:
            kinds.append(error.kind)
    assert "capacity" in kinds and kinds[0] == "ok"
    for i in range(6):
        engine.abort(f"q{i}")


def test_a_request_that_could_never_run_says_why_even_when_the_queue_is_full(make_engine):
    engine = make_engine(num_slots=2, reserved_slots=1, max_waiting=1)
    session = engine.sessions.create(None).result(10)
    endless = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    names = ["running-0", "running-1", "waiting"]  # two hold the slots, one waits for them: the queue is full
    for name in names:
        engine.submit(EngineRequest(name, [1, 2], endless), Collector()).result(10)
        while name != "waiting" and engine.counts().result(10)[0] < int(name[-1]) + 1:  # (running before the next)
            time.sleep(0.01)
    with pytest.raises(EngineError) as full:
        engine.submit(EngineRequest("more", [1, 2], endless), Collector()).result(10)
    assert full.value.kind == "capacity"
    # retrying later would not help it: its 400, not the queue's 429
    with pytest.raises(EngineError) as refused:
        engine.submit(EngineRequest("bad", [1, 2], SamplingParams(max_tokens=1, n=99)), Collector()).result(10)
    assert refused.value.kind != "capacity" and refused.value.param == "n", refused.value
    with pytest.raises(EngineError) as refused:  # a session's turn the same: n must be 1 there
        engine.submit(EngineRequest("bad-turn", [1, 2], SamplingParams(max_tokens=1, n=2), session_id=session.id),
                      Collector()).result(10)
    assert refused.value.param == "n", refused.value
    with pytest.raises(EngineError) as full:  # a good turn waits its turn: the queue's 429 leaves the session free
        engine.submit(EngineRequest("turn", [1, 2], GREEDY, session_id=session.id), Collector()).result(10)
    assert full.value.kind == "capacity"
    for name in names:
        engine.abort(name)
    assert tokens_of(run(engine, [1, 2], GREEDY, "turn-again", session_id=session.id))  # (not left busy: no 409)


def test_sessions_offload_to_host_and_come_back(make_engine):
    engine = make_engine(num_slots=2)
    sessions = [engine.sessions.create(None).result(10) for _ in range(4)]
    for i, s in enumerate(sessions):
        run(engine, prompt(8, i), SamplingParams(max_tokens=0), f"fill{i}", session_id=s.id)
    tiers = [engine.sessions.info(s.id, None).result(10).tier for s in sessions]
    assert tiers.count("device") <= 2 and "host" in tiers
    # the first session was offloaded (least recently used); it comes back transparently and exactly
    before = tokens_of(run(engine, [1, 2], GREEDY, "back", session_id=sessions[0].id))
    twin = engine.sessions.create(None).result(10)
    run(engine, prompt(8, 0), SamplingParams(max_tokens=0), "twin0", session_id=twin.id)
    assert tokens_of(run(engine, [1, 2], GREEDY, "twin1", session_id=twin.id)) == before


def test_session_errors(make_engine):
    engine = make_engine()
    with pytest.raises(EngineError) as error:
        engine.sessions.info("sess-nope", None).result(10)
    assert error.value.kind == "not_found"
    mine = engine.sessions.create("key-a").result(10)
    with pytest.raises(EngineError) as error:
        engine.sessions.info(mine.id, "key-b").result(10)
    assert error.value.kind == "not_found"
    sink = Collector()
    engine.submit(
        EngineRequest(
            "busy",
            prompt(5),
            SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True),
            session_id=mine.id,
            owner="key-a",
        ),
        sink,
    ).result(10)
    with pytest.raises(EngineError) as error:
        engine.submit(
            EngineRequest("busy2", [1], SamplingParams(), session_id=mine.id, owner="key-a"), Collector()
        ).result(10)
    assert error.value.kind == "busy"
    engine.abort("busy")
    sink.wait()
    engine.sessions.delete(mine.id, "key-a").result(10)
    with pytest.raises(EngineError):
        engine.sessions.info(mine.id, "key-a").result(10)


def test_prefix_cache_hit_gives_identical_output(make_engine):
    engine = make_engine(prefix_cache_entries=8)
    shared = prompt(48, 12)
    first = tokens_of(run(engine, shared + [1, 2, 3], GREEDY, "cold"))
    second = tokens_of(run(engine, shared + [1, 2, 3], GREEDY, "warm"))
    assert first == second
    hits = [s.prefix_cache_hit for s in engine.test_stats if hasattr(s, "prefix_cache_hit")]
    assert hits[:2] == [False, True]
    assert engine.prefix_cache.bytes_in_use == len(engine.prefix_cache) * engine.pool.slot_bytes


def test_bad_requests_are_rejected_with_a_reason(make_engine):
    engine = make_engine()
    for ids, params, param in [
        ([], SamplingParams(), "prompt"),
        ([5000], SamplingParams(), "prompt"),
        ([1], SamplingParams(n=99), "n"),
    ]:
        with pytest.raises(EngineError) as error:
            engine.submit(EngineRequest(f"bad{param}{len(ids)}", ids, params), Collector()).result(10)
        assert error.value.param == param
    with pytest.raises(EngineError) as error:
        SamplingParams(top_p=0)
    assert error.value.param == "top_p"


def test_stop_aborts_running_streams(make_engine):
    engine = make_engine(num_slots=4)
    sink = Collector()
    engine.submit(
        EngineRequest("forever", prompt(4), SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True)), sink
    ).result(10)
    sink.queue.get(timeout=10)
    assert assert_slots_balance(engine)["running_rows"] == 1  # (the teardown checks only live engines)
    started = time.monotonic()
    engine.stop()
    assert sink.wait()[-1].finish_reason is FinishReason.ABORT
    assert time.monotonic() - started < 60  # a hang's bound only: a million tokens would take hours


def test_idle_sessions_expire_after_ttl(make_engine):
    engine = make_engine(session_ttl_s=0.2)
    session = engine.sessions.create(None).result(10)
    assert engine.sessions.info(session.id, None).result(10).id == session.id
    time.sleep(1.3)  # TTL plus the once-a-second expiry sweep
    engine.counts().result(10)  # let the engine loop run a sweep
    with pytest.raises(EngineError):
        engine.sessions.info(session.id, None).result(10)
    assert engine.pool.used_slots == 0


@pytest.fixture
def softmax_engine(make_engine, device):
    from linserve.model import LinearGPT, ModelConfig

    torch.manual_seed(0)
    model = (
        LinearGPT(
            ModelConfig(
                vocab_size=1024, d_model=64, n_layers=2, n_heads=4, attention="softmax", decay=True, conv_kernel=3
            )
        )
        .eval()
        .to(device)
    )
    return make_engine(model=model, num_slots=6, max_context=128, max_prefill_chunk=16), model


def test_softmax_model_served_from_kv_pool_matches_its_own_loop(softmax_engine):
    engine, model = softmax_engine
    ids = prompt(23, 13)
    sinks = {}
    for i, length in enumerate([23, 5, 40]):  # rows of different lengths share decode steps
        sink = Collector()
        engine.submit(EngineRequest(f"s{i}", ids if i == 0 else prompt(length, i), GREEDY), sink).result(10)
        sinks[i] = sink
    got = tokens_of(sinks[0].wait())
    for sink in list(sinks.values())[1:]:
        sink.wait()
    logits, state = model(torch.tensor([ids], device=engine.device))
    expected = []
    for _ in range(12):
        token = int(logits[0, -1].argmax())
        expected.append(token)
        logits, state = model(torch.tensor([[token]], device=engine.device), state)
    assert got == expected
    assert engine.pool.used_slots == 0


def test_softmax_context_limit_and_no_sessions(softmax_engine):
    engine, _ = softmax_engine
    with pytest.raises(EngineError) as error:
        engine.submit(EngineRequest("big", prompt(100), SamplingParams(max_tokens=50)), Collector()).result(10)
    assert error.value.param == "max_tokens" and "max context" in error.value.message
    with pytest.raises(EngineError, match="linear-attention"):
        engine.sessions.create(None).result(10)
