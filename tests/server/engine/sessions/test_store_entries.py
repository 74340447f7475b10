"""A session's own entries (stored responses) and keyed results, in both stores (Redis: a real redis-server):
kept within their budget, removed and expiring with the session, keyed results until their TTL."""

from __future__ import annotations

import time

import pytest

from linserve.server.engine.sessions.backends import open_store

SESSION = "sess-entries-test"


@pytest.fixture(params=["dir", "redis"])
def store(request, tmp_path):
    if request.param == "dir":
        yield open_store(f"dir:{tmp_path / 'store'}")
        return
    url, _ = request.getfixturevalue("redis_url")
    yield open_store(url, ttl_s=2.0)


def test_entries_live_and_die_with_their_session(store):
    store.put(SESSION, b"record", "r1", "owner")
    assert store.put_entry(SESSION, "response:resp_a_1", b"x" * 60, budget=100)
    assert store.put_entry(SESSION, "response:resp_a_2", b"y" * 40, budget=100)
    assert not store.put_entry(SESSION, "response:resp_a_3", b"z", budget=100)  # 101 bytes: over the budget
    assert store.get_entry(SESSION, "response:resp_a_3") is None
    assert store.put_entry(SESSION, "response:resp_a_2", b"w" * 30, budget=100)  # replacing counts the new size
    assert store.put_entry(SESSION, "response:resp_a_3", b"z" * 10, budget=100)
    assert store.get_entry(SESSION, "response:resp_a_1") == b"x" * 60
    store.delete_entry(SESSION, "response:resp_a_1")
    assert store.get_entry(SESSION, "response:resp_a_1") is None
    assert store.put_entry(SESSION, "response:resp_a_4", b"v" * 60, budget=100)  # its bytes were given back
    store.delete(SESSION, "owner")
    assert store.get_entry(SESSION, "response:resp_a_2") is None
    assert store.get_entry(SESSION, "response:resp_a_4") is None
    assert store.put_entry(SESSION, "response:resp_a_5", b"u" * 100, budget=100)  # a new life starts from zero


def test_a_name_that_is_not_an_entry_is_refused(store):
    with pytest.raises(ValueError):
        store.put_entry(SESSION, "../escape", b"x", budget=100)
    with pytest.raises(ValueError):
        store.put_entry("not-a-session", "response:resp_a_1", b"x", budget=100)
    assert store.get_entry(SESSION, "../escape") is None


def test_keyed_results_last_their_ttl(store):
    store.put_key("idem-abc", b'{"status": 200}', ttl_s=0.5)
    store.put_key("idem-long", b"kept", ttl_s=60)
    assert store.get_key("idem-abc") == b'{"status": 200}'
    time.sleep(0.6)
    assert store.get_key("idem-abc") is None and store.get_key("idem-long") == b"kept"
    assert store.get_key("../escape") is None


def test_redis_entries_expire_with_the_session_and_each_write_renews_them(redis_url):
    store = open_store(redis_url[0], ttl_s=1.0)
    store.put(SESSION, b"record", "r1", "owner")
    assert store.put_entry(SESSION, "response:resp_a_1", b"x", budget=100)
    for _ in range(3):  # 1.5 s in all: alive only because every turn's write renews the session and its entries
        time.sleep(0.5)
        store.put(SESSION, b"record", "r2", "owner")
    assert store.get_entry(SESSION, "response:resp_a_1") == b"x"
    deadline = time.monotonic() + 10  # a hang's bound: Redis expires lazily or within its cycle
    while store.get_entry(SESSION, "response:resp_a_1") is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.get(SESSION) is None and store.get_entry(SESSION, "response:resp_a_1") is None


def test_a_dir_store_sweeps_entry_and_key_temporaries_left_by_a_killed_process(tmp_path):
    store = open_store(f"dir:{tmp_path / 'store'}")
    store.put(SESSION, b"record", "r1", "owner")
    assert store.put_entry(SESSION, "response:resp_a_1", b"x", budget=100)
    store.put_key("idem-abc", b"kept", ttl_s=60)
    left = [tmp_path / "store" / "entries" / SESSION / ".response:resp_a_2.0f.tmp", tmp_path / "store" / "keys" /
            ".idem-def.0f.tmp"]
    for path in left:
        path.write_bytes(b"half")
    reopened = open_store(f"dir:{tmp_path / 'store'}")
    assert not any(path.exists() for path in left)
    assert reopened.get_entry(SESSION, "response:resp_a_1") == b"x" and reopened.get_key("idem-abc") == b"kept"
