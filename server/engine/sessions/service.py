"""The session commands (any thread): each returns a future. `Engine` builds one `SessionService` with what
it needs — the registry, the store worker, and `call` / `internal_call`, which run a function on the
engine thread — and exposes it as `engine.sessions`.

A command that names a session runs in up to three hops, and the engine thread never waits for I/O:
1. lookup (store thread): the record if this process holds no current copy, the revision and, for a
   change on a shared store, the lease — `StoreAccess.lookup`;
2. act (engine thread): the change in memory; it returns the answer, or a `StoreStep`;
3. store, then settle: the step runs on the store thread (with its deadline), then settles on the engine
   thread — the answer, or the rollback and a 503 — so 2xx always means stored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from . import copies
from .failures import SessionBusy, StaleLookup, store_failure
from .leases import LEASE_GRACE_S, LeaseHeld, Lookup
from .listing import list_sessions
from .records import Session
from .registry import SessionRegistry
from .worker import StoreStep, StoreWorker

LOOKUP_ATTEMPTS = 3  # a session that changes under every lookup (it cannot, short of a bug) is a 503


class SessionService:
    def __init__(self, registry: SessionRegistry, worker: StoreWorker | None, call: Callable[[Callable], Future],
                 internal_call: Callable[[Callable], Future], state_bytes: int,
                 on_skipped_record: Callable[[str, str], None] = lambda session_id, reason: None,
                 on_loaded: Callable[[], None] = lambda: None) -> None:
        self.registry, self.worker = registry, worker
        self.on_loaded = on_loaded
        self._call, self._internal_call = call, internal_call
        self.state_bytes = state_bytes
        self.on_skipped_record = on_skipped_record
        registry.on_vanished = self._write_back

    def _write_back(self, session_ids: list[str]) -> None:
        """Store thread: sessions held here whose records vanished are written again (on the engine thread)."""
        def write() -> None:
            for step in self.registry.write_back(session_ids):
                self.run_store_step(step)

        self._internal_call(write)

    def create(self, owner: str | None, first_prompt: bool = False) -> Future:
        """`first_prompt`: the caller continues the session with a prompt at once; that turn writes the record
        (until then it exists in this process only, and a failure leaves nothing in the store)."""
        return self.command(lambda _: self.registry.create(owner, first_prompt))

    def info(self, session_id: str, owner: str | None) -> Future:
        return self.command(self.registry.info, session_id, owner)

    def fork(self, session_id: str, owner: str | None, at_turn: int | None = None) -> Future:
        return self.command(lambda source: copies.fork(self.registry, source, owner, at_turn), session_id, owner)

    def kept_result(self, session_id: str, owner: str | None, key: str) -> Future:
        return self.command(lambda session: copies.kept_result(self.registry, session, key), session_id, owner)

    def forget(self, session_id: str, owner: str | None, key: str) -> Future:
        return self.command(lambda session: copies.forget(self.registry, session, key), session_id, owner, claim=True)

    def export(self, session_id: str, owner: str | None) -> Future:
        return self.command(lambda session: copies.export(self.registry, session), session_id, owner)

    def import_(self, data: bytes, owner: str | None) -> Future:
        return self.command(lambda _: copies.import_(self.registry, data, owner))

    def turns(self, session_id: str, owner: str | None) -> Future:
        """(the kept turn snapshots, the kept turn texts) of a session."""
        return self.command(lambda session: (list(session.turns), list(session.texts)), session_id, owner)

    def rewind(self, session_id: str, owner: str | None, turn: int, idempotency=None) -> Future:
        return self.command(lambda session: self.registry.rewind(session, turn, idempotency), session_id, owner,
                            claim=True)

    def delete(self, session_id: str, owner: str | None, wait_s: float = LEASE_GRACE_S) -> Future:
        """`wait_s`: how long a session busy here or elsewhere is waited for before a 409."""
        return self.command(self.registry.delete, session_id, owner, claim=True, wait_s=wait_s)

    def keyed_result(self, name: str) -> Future:
        """What the store keeps under `name` (an Idempotency-Key's answer), or None; read on the store thread."""
        if self.worker is None:
            return _done(None)
        store = self.registry.store
        return self.worker.submit("get", lambda deadline: store.get_key(name))

    def keep_keyed_result(self, name: str, data: bytes, ttl_s: float) -> Future:
        if self.worker is None:
            return _done(None)
        store = self.registry.store
        return self.worker.submit("put", lambda deadline: store.put_key(name, data, ttl_s))

    def list(self, owner: str | None, after: str | None, limit: int, descending: bool) -> Future:
        """(a page of the caller's sessions, whether more follow): the in-memory ones snapshotted on the engine
        thread, the store's read on the store thread (see listing.py)."""
        def snapshot(_) -> object:
            memory = self.registry.owned_infos(owner)
            if self.worker is None:
                return list_sessions(memory, None, owner or "", after, limit, descending, self.state_bytes)
            return StoreStep("list", lambda deadline: list_sessions(
                memory, self.registry.store, owner or "", after, limit, descending, self.state_bytes,
                self.on_skipped_record))

        return self.command(snapshot)

    # ------------------------------------------------------------------ the hops
    def command(self, act: Callable[[Session | None], object], session_id: str | None = None,
                         owner: str | None = None, claim: bool = False, wait_s: float = LEASE_GRACE_S) -> Future:
        """`act(session)` on the engine thread after the store lookup (see the module doc); a StoreStep it
        returns is run, then settled, before the future resolves. A session busy here or on another replica
        is waited for up to `wait_s` (a turn that is finishing stores its record in milliseconds)."""
        outer: Future = Future()
        grace_until = time.monotonic() + wait_s
        attempts = [0]

        def look(refetch: bool = False) -> None:
            if session_id is None or self.worker is None:
                act_on(None)
                return
            if not self.registry.shared and not refetch and self.registry.holds(session_id):
                act_on(Lookup(session_id, None, None, None, fetched=False))  # nothing to read (re-checked there)
                return
            access = self.registry.access
            looked = self.worker.submit(
                "get", lambda deadline: access.lookup(session_id, claim, refetch, deadline))
            looked.add_done_callback(lambda f: after_lookup(f))

        def later() -> None:
            timer = threading.Timer(0.02, look)
            timer.daemon = True
            timer.start()

        def after_lookup(looked: Future) -> None:
            error = looked.exception()
            if isinstance(error, LeaseHeld) and time.monotonic() < grace_until:
                later()
            elif error is not None:
                outer.set_exception(store_failure(error, "the session could not be read"))
            else:
                found = looked.result()
                if found.fetched and found.data is not None:
                    self.on_loaded()
                act_on(found)

        def act_on(found: Lookup | None) -> None:
            self._call(lambda: self._act(act, session_id, owner, claim, found)).add_done_callback(after_act)

        def after_act(acted: Future) -> None:
            error = acted.exception()
            if claim and isinstance(error, SessionBusy) and time.monotonic() < grace_until:
                later()
            elif isinstance(error, StaleLookup) and attempts[0] < LOOKUP_ATTEMPTS:
                attempts[0] += 1
                look(refetch=True)
            elif isinstance(error, StaleLookup):
                outer.set_exception(store_failure(error, "the session kept changing while it was read"))
            elif error is not None:
                outer.set_exception(error)
            elif isinstance(acted.result(), StoreStep):
                self.run_store_step(acted.result(), outer)
            else:
                outer.set_result(acted.result())

        look()
        return outer

    def _act(self, act: Callable, session_id: str | None, owner: str | None, claim: bool, found: Lookup | None):
        """Engine thread: resolve the session (a lease taken for it is given back if anything fails)."""
        try:
            session = None
            if session_id is not None:
                session = self.registry.resolve(session_id, owner, found)
                if claim:
                    self.registry.claim(session, found)
            return act(session)
        except BaseException:
            if found is not None and found.lease is not None and (session is None or session.lease == found.lease):
                if session is not None:
                    session.lease = None
                self.registry.give_back_lease(found.session_id, found.lease)
            raise

    def run_store_step(self, step: StoreStep, outer: Future | None = None) -> None:
        """Run the step on the store thread, then settle it on the engine thread; the answer goes to `outer`."""
        def stored(done: Future) -> None:
            error = done.exception()
            if step.settle is None:
                if outer is not None:
                    if error is None:
                        outer.set_result(done.result())
                    else:
                        outer.set_exception(store_failure(error, "the sessions could not be listed"))
                return
            result = None if error is not None else done.result()
            settled = self._internal_call(lambda: step.settle(error, result))
            if outer is not None:
                settled.add_done_callback(lambda s: outer.set_exception(s.exception()) if s.exception() is not None
                                          else outer.set_result(s.result()))

        self.worker.submit(step.op, step.run).add_done_callback(stored)


def _done(result: object) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
