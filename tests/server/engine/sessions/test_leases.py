"""leases.py against a real redis-server: a lease whose release the store missed is given back when the store
answers again — even when a claim made during the outage failed too (its token must not replace the one the
store really holds)."""

from __future__ import annotations

import time

import pytest

from linserve.server.engine.sessions.backends import open_store
from linserve.server.engine.sessions.leases import LeaseHeld, StoreAccess
from tests.helpers import free_port, start_redis

SESSION = "sess-lease-test"


def nothing_held(session_id: str) -> tuple[bool, str | None]:
    return False, None


def test_a_lease_kept_through_an_outage_and_a_failed_claim_is_released_when_the_store_returns(tmp_path):
    port = free_port()
    url, redis = start_redis(tmp_path, port=port, durable=True)  # durable: the lease outlives the restart
    try:
        store = open_store(url, timeout_s=0.5)
        access = StoreAccess(store, nothing_held)
        first = access.lookup(SESSION, claim=True, refetch=False, deadline=None)
        assert first.lease is not None
        redis.kill()
        redis.wait(10)
        assert access.release(SESSION, first.lease) is False  # kept for a retry
        with pytest.raises(Exception):  # noqa: B017 - a connection error (the store is down), not a timeout
            access.lookup(SESSION, claim=True, refetch=False, deadline=None)
        url, redis = start_redis(tmp_path, port=port, durable=True)
        deadline = time.monotonic() + 30  # a hang's bound: Redis replays its file
        while True:
            try:
                store.revision(SESSION)
                break
            except Exception:  # noqa: BLE001
                assert time.monotonic() < deadline
                time.sleep(0.1)
        access.retry_releases()  # what the store worker does after its first good probe
        try:
            again = access.lookup(SESSION, claim=True, refetch=False, deadline=None)
        except LeaseHeld:
            pytest.fail("the lease the store held was not given back: the failed claim's token replaced it")
        access.release(SESSION, again.lease)
    finally:
        redis.kill()
