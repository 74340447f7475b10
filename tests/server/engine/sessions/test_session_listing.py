"""Listing a caller's sessions across tiers: memory (device, host) merged with the store's owner index, in
creation order, a page at a time — after a restart, across replicas on one Redis, with expired records."""

from __future__ import annotations

import shutil
import time

from linserve.server.engine import SamplingParams
from linserve.server.engine.sessions.dir_store import DirStore
from tests.helpers import assert_slots_balance, run


def all_pages(engine, owner, limit: int, descending: bool = True) -> list:
    """Every session of `owner`, page by page; each page within the limit, has_more true until the last."""
    found, after = [], None
    while True:
        page, more = engine.sessions.list(owner, after, limit, descending).result(10)
        assert len(page) <= limit and (len(page) == limit or not more)
        found += page
        if not more:
            return found
        after = page[-1].id


def create(engine, owner, count: int, tokens: int = 0) -> list[str]:
    ids = []
    for _ in range(count):
        session = engine.sessions.create(owner).result(10)
        if tokens:
            run(engine, list(range(1, tokens + 1)), SamplingParams(max_tokens=0), f"{session.id}-p", session.id, owner)
        ids.append(session.id)
        time.sleep(0.002)  # ids carry the millisecond they were made in: distinct creation times
    return ids


def test_pages_cover_every_session_once_in_creation_order_per_owner(make_engine):
    engine = make_engine(num_slots=8, session_store="none")
    mine, theirs = create(engine, "me", 7), create(engine, "them", 2)
    for limit in (1, 3, 7, 100):
        newest_first = all_pages(engine, "me", limit)
        assert [s.id for s in newest_first] == mine[::-1]
        assert [s.id for s in all_pages(engine, "me", limit, descending=False)] == mine
    assert [s.id for s in all_pages(engine, "them", 2)] == theirs[::-1]
    assert all_pages(engine, None, 5) == []  # no key's sessions: none here
    engine.sessions.delete(mine[3], "me").result(10)
    assert mine[3] not in [s.id for s in all_pages(engine, "me", 2)]
    assert_slots_balance(engine)


def test_after_a_restart_store_sessions_are_listed_and_merged_with_memory(make_engine, tmp_path):
    store = f"dir:{tmp_path / 'sessions'}"
    first = make_engine(num_slots=8, session_store=store)
    ids = create(first, "me", 6, tokens=5)
    create(first, "other", 1)
    first.stop()
    second = make_engine(num_slots=8, session_store=store)
    listed = all_pages(second, "me", 4)
    assert [s.id for s in listed] == ids[::-1] and {s.tier for s in listed} == {"store"}
    assert all(s.tokens == 5 and s.state_bytes == second.pool.slot_bytes for s in listed)
    assert all(s.created <= s.last_used for s in listed)
    # two come back into memory (host tier) and one more is made: the merge still lists each once, in order
    for session_id in (ids[1], ids[4]):
        second.sessions.info(session_id, "me").result(10)
    ids += create(second, "me", 1)
    listed = all_pages(second, "me", 2, descending=False)
    assert [s.id for s in listed] == ids
    assert [s.tier for s in listed] == ["store", "host", "store", "store", "host", "store", "device"]
    assert_slots_balance(second)


def test_a_record_gone_from_the_store_drops_its_index_entry(make_engine, tmp_path):
    path = tmp_path / "sessions"
    first = make_engine(num_slots=8, session_store=f"dir:{path}")
    ids = create(first, "me", 3)
    first.stop()
    (path / f"{ids[1]}.lsess").unlink()  # as the TTL sweep of another process would
    second = make_engine(num_slots=8, session_store=f"dir:{path}")
    assert [s.id for s in all_pages(second, "me", 1)] == [ids[2], ids[0]]
    assert sorted(second.registry.store.owned("me", None, 10, False)) == [ids[0], ids[2]]


def test_the_owner_index_is_rebuilt_from_the_records(make_engine, tmp_path):
    path = tmp_path / "sessions"
    first = make_engine(num_slots=8, session_store=f"dir:{path}")
    ids = create(first, "me", 3)
    first.stop()
    shutil.rmtree(path / "owners")  # a directory written before the index existed
    assert DirStore(path).owned("me", None, 10, descending=False) == ids


def test_replicas_on_one_redis_list_the_same_sessions(make_engine, redis_url):
    url, _ = redis_url
    a = make_engine(num_slots=8, session_store=url)
    b = make_engine(num_slots=8, session_store=url)
    ids = create(a, "me", 5, tokens=3)
    a.store_worker.flush()  # each turn's record is written off the hot path: B sees it once it has landed
    on_b = all_pages(b, "me", 2)
    assert [s.id for s in on_b] == ids[::-1] and {s.tier for s in on_b} == {"store"} and on_b[0].tokens == 3
    b.sessions.info(ids[0], "me").result(10)  # b holds it now
    assert [s.tier for s in all_pages(b, "me", 10, descending=False)][0] == "host"
    a.sessions.delete(ids[2], "me").result(10)
    a.store_worker.flush()
    assert [s.id for s in all_pages(b, "me", 3)] == [ids[4], ids[3], ids[1], ids[0]]
    assert all_pages(a, "other", 3) == []
    # a record Redis expired leaves an index entry behind: the listing drops it
    short = make_engine(num_slots=8, session_store=url, session_ttl_s=0.3)
    brief = short.sessions.create("me").result(10)
    time.sleep(0.6)
    assert [s.id for s in all_pages(b, "me", 10)] == [ids[4], ids[3], ids[1], ids[0]]  # the others stay
    assert brief.id not in b.registry.store.owned("me", None, 100, False)
