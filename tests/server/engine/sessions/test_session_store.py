"""The dir session store: every turn is written; a new engine on the same directory continues every
session exactly (turns and penalties included); a corrupt record is a clear error and the others load."""

from __future__ import annotations

import os
import time

import pytest

from linserve.server.engine import EngineError, EngineRequest, SamplingParams
from linserve.server.engine.sessions.dir_store import DirStore
from linserve.server.engine.types import RecordSkipped, StoreStats
from tests.helpers import Collector, prompt, run, tokens_of

GREEDY_4 = SamplingParams(max_tokens=4, temperature=0)

PENALISED = SamplingParams(max_tokens=8, temperature=0.9, seed=2, repetition_penalty=1.5, ignore_eos=True)



@pytest.fixture
def store_engine(make_engine, tmp_path):
    """Engines on one store directory (a second one is the first after a restart)."""
    return lambda: make_engine(num_slots=8, session_store=f"dir:{tmp_path / 'sessions'}")


def store_ops(engine) -> list:
    return [s for s in engine.test_stats if isinstance(s, StoreStats)]


def test_a_restarted_engine_continues_every_session_exactly(store_engine, tmp_path):
    first = store_engine()
    a = first.sessions.create("owner-a").result(10)
    run(first, prompt(20, 1), SamplingParams(max_tokens=0), "a1", session_id=a.id, owner="owner-a")
    run(first, [5, 6], PENALISED, "a2", session_id=a.id, owner="owner-a")
    b = first.sessions.create(None).result(10)
    run(first, prompt(9, 2), PENALISED, "b1", session_id=b.id)
    # the reference: what the sessions give without any restart (on a fork, which leaves them untouched)
    fork_a = first.sessions.fork(a.id, "owner-a").result(10)
    expected_a = tokens_of(run(first, [7], PENALISED, "fa", session_id=fork_a.id, owner="owner-a"))
    first.stop()  # flushes the writer
    assert all(op.result == "ok" for op in store_ops(first)) and store_ops(first)
    second = store_engine()
    assert second.sessions.info(a.id, "owner-a").result(10).tier == "host"
    with pytest.raises(EngineError) as error:
        second.sessions.info(a.id, "owner-b").result(10)  # ownership travels with the record
    assert error.value.kind == "not_found"
    assert tokens_of(run(second, [7], PENALISED, "a3", session_id=a.id, owner="owner-a")) == expected_a
    turns = second.sessions.turns(a.id, "owner-a").result(10)[0]
    assert [t.index for t in turns] == [1, 2, 3]
    # rewind survives the restart too: back to turn 2 and ask again = the same answer
    second.sessions.rewind(a.id, "owner-a", 2).result(10)
    assert tokens_of(run(second, [7], PENALISED, "a3b", session_id=a.id, owner="owner-a")) == expected_a
    assert second.sessions.info(b.id, None).result(10).tokens == 9 + 8


def test_a_corrupt_record_is_a_clear_error_and_the_others_load(store_engine, tmp_path):
    first = store_engine()
    good = first.sessions.create(None).result(10)
    bad = first.sessions.create(None).result(10)
    run(first, prompt(5), SamplingParams(max_tokens=0), "g", session_id=good.id)
    first.stop()
    record = tmp_path / "sessions" / f"{bad.id}.lsess"
    record.write_bytes(record.read_bytes()[:100])  # torn, as if written without the atomic rename
    second = store_engine()
    with pytest.raises(EngineError) as error:
        second.sessions.info(bad.id, None).result(10)
    assert error.value.kind == "invalid" and "unreadable" in error.value.message
    assert second.sessions.info(good.id, None).result(10).tokens == 5


def test_deleted_sessions_leave_the_store(store_engine, tmp_path):
    engine = store_engine()
    session = engine.sessions.create(None).result(10)
    engine.store_worker.flush()
    assert (tmp_path / "sessions" / f"{session.id}.lsess").exists()
    engine.sessions.delete(session.id, None).result(10)
    engine.store_worker.flush()
    assert not (tmp_path / "sessions" / f"{session.id}.lsess").exists()
    assert DirStore(tmp_path / "sessions").count() == 0


def test_a_delete_is_answered_once_its_record_is_gone(store_engine, tmp_path, monkeypatch):
    engine = store_engine()
    session = engine.sessions.create(None).result(10)
    record = tmp_path / "sessions" / f"{session.id}.lsess"
    assert record.exists()  # a create is answered once stored
    slow_delete = engine.registry.store.delete

    def delete_later(*args):
        time.sleep(0.5)
        slow_delete(*args)

    monkeypatch.setattr(engine.registry.store, "delete", delete_later)
    deleted = engine.sessions.delete(session.id, None)
    time.sleep(0.2)
    assert not deleted.done() and record.exists()  # not acknowledged while the record is still there
    deleted.result(10)
    assert not record.exists()
    with pytest.raises(EngineError) as error:
        engine.sessions.info(session.id, None).result(10)
    assert error.value.kind == "not_found"


def test_redis_store_restart_expiry_and_outage(make_engine, redis_url):
    url, server = redis_url
    first = make_engine(num_slots=8, session_store=url, session_ttl_s=3600)
    session = first.sessions.create("owner").result(10)
    run(first, prompt(15, 3), SamplingParams(max_tokens=0), "r1", session_id=session.id, owner="owner")
    twin = first.sessions.fork(session.id, "owner").result(10)
    expected = tokens_of(run(first, [4], PENALISED, "rt", session_id=twin.id, owner="owner"))
    first.stop()
    assert all(op.result == "ok" for op in store_ops(first))
    second = make_engine(num_slots=8, session_store=url)
    assert tokens_of(run(second, [4], PENALISED, "r2", session_id=session.id, owner="owner")) == expected
    # keys carry the session TTL: Redis forgets them by itself
    short = make_engine(num_slots=8, session_store=url, session_ttl_s=0.3)
    brief = short.sessions.create(None).result(10)
    short.store_worker.flush()
    time.sleep(0.6)
    assert short.registry.store.get(brief.id) is None
    # Redis gone: a session that must be loaded is a 503-kind error, stateless work goes on
    server.kill()
    server.wait(10)
    with pytest.raises(EngineError) as error:
        second.sessions.info(twin.id, "owner").result(30)
    assert error.value.kind == "store_unavailable"
    assert tokens_of(run(second, prompt(4), SamplingParams(max_tokens=3, temperature=0), "stateless"))


def test_replicas_on_one_redis_serve_the_same_sessions(make_engine, redis_url):
    """Two engines (replicas) on one Redis: a session created on one and continued alternately on both
    gives the tokens of one engine that never shared it; each sees the other's turns, rewinds and deletes;
    the lease makes a concurrent continuation a 409 and a dead replica's lease expires."""
    url, _ = redis_url
    alone = make_engine(num_slots=8)
    a, b = make_engine(num_slots=8, session_store=url), make_engine(num_slots=8, session_store=url)
    turns = [([4, 5], PENALISED), ([6], SamplingParams(max_tokens=6, temperature=0)),
             ([7, 8, 9], PENALISED), ([10], SamplingParams(max_tokens=5, temperature=0.7, seed=11))]
    reference = alone.sessions.create("k").result(10)
    run(alone, prompt(17, 4), SamplingParams(max_tokens=0), "ref0", session_id=reference.id, owner="k")
    expected = [tokens_of(run(alone, ids, params, f"ref{i}", session_id=reference.id, owner="k"))
                for i, (ids, params) in enumerate(turns, 1)]
    shared = a.sessions.create("k").result(10)
    run(b, prompt(17, 4), SamplingParams(max_tokens=0), "s0", session_id=shared.id, owner="k")
    for i, (ids, params) in enumerate(turns, 1):
        replica = (a, b)[i % 2]  # A, B, A, B: each continues from what the other wrote
        assert tokens_of(run(replica, ids, params, f"s{i}", session_id=shared.id, owner="k")) == expected[i - 1]
    assert a.sessions.info(shared.id, "k").result(10).tokens == alone.sessions.info(reference.id, "k").result(10).tokens
    with pytest.raises(EngineError):
        b.sessions.info(shared.id, "other-key").result(10)  # ownership is in the record, on every replica
    # a rewind on B is what A continues from
    b.sessions.rewind(shared.id, "k", 4).result(10)  # turn 1 was the prompt; 4 is before the last answer
    again = tokens_of(run(a, *turns[3], "s5", session_id=shared.id, owner="k"))
    assert again == expected[3]
    # one generation at a time across replicas: B's continuation while A generates is a 409
    sink = Collector()
    a.submit(EngineRequest("long", [3], SamplingParams(max_tokens=100_000, ignore_eos=True), session_id=shared.id,
                           owner="k"), sink).result(10)
    sink.queue.get(timeout=10)  # A is generating
    with pytest.raises(EngineError) as error:
        b.submit(EngineRequest("second", [3], GREEDY_4, session_id=shared.id, owner="k"), Collector()).result(10)
    assert error.value.kind == "busy" and "another replica" in error.value.message
    a.abort("long")
    sink.wait()
    assert tokens_of(run(b, [3], GREEDY_4, "after", session_id=shared.id, owner="k"))  # released after its write
    # a replica that died mid-turn leaves a lease that expires
    a.store_worker.flush()
    b.store_worker.flush()
    assert a.registry.store.acquire(shared.id, "a-dead-replica", 1500)  # outlasts the 0.5 s grace
    with pytest.raises(EngineError) as error:
        run(a, [3], GREEDY_4, "blocked", session_id=shared.id, owner="k")
    assert error.value.kind == "busy"
    time.sleep(1.0)
    assert tokens_of(run(a, [3], GREEDY_4, "expired", session_id=shared.id, owner="k"))
    # fork on A continued on B == export from A imported on B continued on A
    fork = a.sessions.fork(shared.id, "k").result(10)
    imported = b.sessions.import_(a.sessions.export(shared.id, "k").result(10), "k").result(10)
    assert (tokens_of(run(b, [3], PENALISED, "fork", session_id=fork.id, owner="k"))
            == tokens_of(run(a, [3], PENALISED, "imported", session_id=imported.id, owner="k")))
    # deleted on one replica: gone on the other (its in-memory copy is dropped, not served)
    b.sessions.delete(shared.id, "k").result(10)
    b.store_worker.flush()
    with pytest.raises(EngineError) as error:
        a.sessions.info(shared.id, "k").result(10)
    assert error.value.kind == "not_found"


def rewrite_metadata(record, **changes) -> None:
    """Re-save a real record with some metadata fields changed (what a hand-edited or foreign record is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(record), "pt") as reader:
        metadata = {**reader.metadata(), **changes}
        tensors = {name: reader.get_tensor(name) for name in reader.keys()}
    save_file(tensors, str(record), metadata=metadata)


@pytest.mark.parametrize("field,value", [("created", "yesterday"), ("turn_count", "many"), ("created", "inf")])
def test_a_record_with_malformed_metadata_is_a_400_naming_the_session(store_engine, tmp_path, field, value):
    first = store_engine()
    broken = first.sessions.create(None).result(10)
    run(first, prompt(5), GREEDY_4, "b", session_id=broken.id)
    first.stop()
    rewrite_metadata(tmp_path / "sessions" / f"{broken.id}.lsess", **{field: value})
    second = store_engine()
    for command in (lambda: second.sessions.info(broken.id, None),
                    lambda: second.submit(EngineRequest("c", [1], GREEDY_4, session_id=broken.id), Collector())):
        with pytest.raises(EngineError) as error:
            command().result(10)
        assert error.value.kind == "invalid" and broken.id in error.value.message
    page, _ = second.sessions.list(None, None, 10, True).result(10)
    if field == "created":
        assert [s.id for s in page] == []  # skipped in the listing too (its created time is not a number)


def test_unreadable_records_are_skipped_by_listings_without_reading_what_they_declare(store_engine, tmp_path):
    engine = store_engine()
    good = engine.sessions.create("me").result(10)
    directory = tmp_path / "sessions"
    owners = next((directory / "owners").iterdir())  # the owner "me"'s index
    for name, data in [("sess-0random", os.urandom(4096)),
                       ("sess-1huge", (2**40).to_bytes(8, "little") + b"{" * 64),  # declares a 1 TiB header
                       ("sess-2short", b"\x01\x02"),
                       ("sess-3notjson", (16).to_bytes(8, "little") + b"\xff" * 16)]:
        (directory / f"{name}.lsess").write_bytes(data)
        (owners / name).touch()
    for _ in range(2):
        page, more = engine.sessions.list("me", None, 10, True).result(10)
        assert [s.id for s in page] == [good.id] and not more
    skipped = [s for s in engine.test_stats if isinstance(s, RecordSkipped)]
    assert len(skipped) == 8  # counted each time a listing meets one
    assert engine.store_worker.up  # a broken record is not a broken store


def test_whatever_the_server_exports_it_imports_back(make_engine):
    """A snapshot at the token limit imports; the session cannot be continued past the limit, so no export
    is ever out of range."""
    engine = make_engine(num_slots=8)
    session = engine.sessions.create(None).result(10)
    run(engine, prompt(3), GREEDY_4, "p", session_id=session.id)
    snapshot = engine.sessions.export(session.id, None).result(10)
    from safetensors.torch import load, save

    from linserve.server.engine.sessions.records import MAX_SESSION_TOKENS
    from linserve.server.engine.sessions.snapshot import _read_metadata

    metadata = {**_read_metadata(snapshot), "tokens": str(MAX_SESSION_TOKENS - 8)}
    near_limit = engine.sessions.import_(save(load(snapshot), metadata=metadata), None).result(10)
    run(engine, [1], SamplingParams(max_tokens=2, temperature=0), "ok", session_id=near_limit.id)  # 3 of 8 left
    with pytest.raises(EngineError) as error:
        run(engine, [1], SamplingParams(max_tokens=8, temperature=0), "past", session_id=near_limit.id)
    assert error.value.kind == "invalid" and error.value.param == "max_tokens"
    exported = engine.sessions.export(near_limit.id, None).result(10)
    again = engine.sessions.import_(exported, None).result(10)
    assert engine.sessions.info(again.id, None).result(10).tokens == MAX_SESSION_TOKENS - 8 + 3
