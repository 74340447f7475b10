"""The session commands (any thread): each returns a future. `Engine` builds one `SessionService` with what
it needs — the registry, the store worker, and `call` / `internal_call`, which run a function on the
engine thread — and exposes it as `engine.sessions`.

A command that names a session runs in up to three hops, and the engine thread never waits for I/O:
1. lookup (store thread): the record if this process holds no current copy, the revision and, for a
   change on a shared store, the lease — `StoreAccess.lookup`;
2. act (engine thread): the change in memory; it returns the answer, or a `StoreStep` (queued on the store
   thread there and then);
3. store, then settle: the step runs on the store thread (with its deadline), then settles on the engine
   thread — the answer, or the rollback and a 503 — so 2xx always means stored.
`_command` is that sequence, top to bottom: a coroutine on the commands' own event loop (a thread that only
waits), retrying a busy session every RETRY_S within its wait and a stale lookup up to LOOKUP_ATTEMPTS times.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

from . import copies
from .failures import SessionBusy, StaleLookup, store_failure
from .leases import LEASE_GRACE_S, LeaseHeld, Lookup
from .listing import list_sessions
from .records import Session, TurnMark
from .registry import SessionRegistry
from .worker import StoreStep, StoreWorker

LOOKUP_ATTEMPTS = 3  # a session that changes under every lookup (it cannot, short of a bug) is a 503
RETRY_S = 0.02  # a session busy here or on another replica is asked again this often (within its wait)


class SessionService:
    def __init__(self, registry: SessionRegistry, worker: StoreWorker | None, call: Callable[[Callable], Future],
                 internal_call: Callable[[Callable], Future], state_bytes: int,
                 on_skipped_record: Callable[[str, str], None] = lambda session_id, reason: None,
                 on_loaded: Callable[[], None] = lambda: None) -> None:
        self.registry, self.worker = registry, worker
        self.on_loaded = on_loaded
        self._call, self._internal_call = call, internal_call
        self._loop = asyncio.new_event_loop()  # where commands wait between their hops (one thread, no work)
        self._thread = threading.Thread(target=self._loop.run_forever, name="linserve-session-commands", daemon=True)
        self._thread.start()
        self.state_bytes = state_bytes
        self.on_skipped_record = on_skipped_record
        registry.upkeep.on_vanished = self._write_back

    def _write_back(self, session_ids: list[str]) -> None:
        """Store thread: sessions held here whose records vanished are written again (on the engine thread)."""
        def write() -> None:
            for step in self.registry.upkeep.write_back(session_ids):
                self.run_store_step(step)

        self._internal_call(write)

    def create(self, owner: str | None, first_prompt: bool = False, prompt_ids: list[int] | None = None) -> Future:
        """`first_prompt`: the caller continues the session with a prompt at once; that turn writes the record
        (until then it exists in this process only, and a failure leaves nothing in the store). `prompt_ids`:
        that prompt, checked before the session exists."""
        return self.command(lambda _: self.registry.create(owner, first_prompt, prompt_ids))

    def info(self, session_id: str, owner: str | None, here: bool = False) -> Future:
        """`here`: this process's copy, if it holds one, without asking the store — for the caller that has just
        written it (a create's answer must not wait on a second store call that an outage can fail)."""
        return self.command(self.registry.info, session_id, owner, here=here)

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
        """(each kept turn snapshot's TurnMark, the kept turn texts) of a session — no state: what a listing shows."""
        return self.command(lambda session: ([TurnMark(t.index, t.tokens, t.created) for t in session.turns],
                                             list(session.texts)), session_id, owner)

    def rewind(self, session_id: str, owner: str | None, turn: int, idempotency=None) -> Future:
        return self.command(lambda session: self.registry.rewind(session, turn, idempotency), session_id, owner,
                            claim=True)

    def delete(self, session_id: str, owner: str | None, wait_s: float = LEASE_GRACE_S) -> Future:
        """`wait_s`: how long a session busy here or elsewhere is waited for before a 409."""
        return self.command(self.registry.delete, session_id, owner, claim=True, wait_s=wait_s)

    def abandon(self, session_id: str, owner: str | None, wait_s: float = LEASE_GRACE_S) -> Future:
        """A session whose create failed after it existed (its caller was told so and never learnt its id): deleted
        — and if the store cannot answer now, dropped here and its record removed once the store answers again
        (`StoreAccess.undo`), so no outage leaves it behind."""
        deleted = self.command(self.registry.delete, session_id, owner, claim=True, wait_s=wait_s)

        def fall_back(future: Future) -> None:
            error = None if future.cancelled() else future.exception()
            if getattr(error, "kind", None) in ("store_unavailable", "outcome_unknown"):
                self._internal_call(lambda: self.registry.abandon(session_id, owner))

        deleted.add_done_callback(fall_back)
        return deleted

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
                owner: str | None = None, claim: bool = False, wait_s: float = LEASE_GRACE_S,
                here: bool = False) -> Future:
        """`act(session)` on the engine thread after the store lookup (see the module doc); a StoreStep it
        returns is run, then settled, before the future resolves. A session busy here or on another replica
        is waited for up to `wait_s` (a turn that is finishing stores its record in milliseconds). `here`: a
        read that takes this process's copy as current when it holds one (no lookup)."""
        return asyncio.run_coroutine_threadsafe(self._command(act, session_id, owner, claim, wait_s, here),
                                                self._loop)

    async def _command(self, act: Callable, session_id: str | None, owner: str | None, claim: bool,
                       wait_s: float, here: bool = False) -> object:
        """The command, hop after hop, on the commands' own event loop (it only waits: the work is the store
        thread's and the engine thread's)."""
        grace_until = time.monotonic() + wait_s
        refetch, stale = False, 0
        while True:
            try:
                found = await self._lookup(session_id, claim, refetch, here)  # 1. store thread
            except LeaseHeld:  # another replica's turn is finishing: wait a little for its write
                if time.monotonic() < grace_until:
                    await asyncio.sleep(RETRY_S)
                    continue
                raise
            except Exception as error:  # noqa: BLE001 - the caller gets the 503 that says what failed
                raise store_failure(error, "the session could not be read") from None
            try:  # 2. engine thread (a StoreStep it returns is queued there, in order with what follows)
                acted = await asyncio.wrap_future(self._call(partial(self._act, act, session_id, owner, claim, found)))
            except SessionBusy:
                if claim and time.monotonic() < grace_until:
                    await asyncio.sleep(RETRY_S)
                    continue
                raise
            except StaleLookup as error:  # the session changed between the lookup and the act: read it again
                if stale < LOOKUP_ATTEMPTS:
                    stale, refetch = stale + 1, True
                    continue
                raise store_failure(error, "the session kept changing while it was read") from None
            if isinstance(acted, _Queued):
                return await self._settle(acted.step, acted.stored)  # 3. store thread, then engine thread
            return acted

    async def _lookup(self, session_id: str | None, claim: bool, refetch: bool, here: bool = False) -> Lookup | None:
        if session_id is None or self.worker is None:
            return None
        if not self.registry.shared and not refetch and self.registry.holds(session_id):
            return Lookup(session_id, None, None, None, fetched=False)  # nothing to read (re-checked there)
        if here and not claim and not refetch:
            held, revision = self.registry.held(session_id)
            if held:  # this process's copy, as current as the store's (resolve re-checks it is still held)
                return Lookup(session_id, None, revision, None, fetched=False)
        access = self.registry.access
        found = await asyncio.wrap_future(
            self.worker.submit("get", lambda deadline: access.lookup(session_id, claim, refetch, deadline)))
        if found.fetched and found.data is not None:
            self.on_loaded()
        return found

    def _act(self, act: Callable, session_id: str | None, owner: str | None, claim: bool, found: Lookup | None):
        """Engine thread: resolve the session (a lease taken for it is given back if anything fails)."""
        try:
            session = None
            if session_id is not None:
                session = self.registry.resolve(session_id, owner, found)
                if claim:
                    self.registry.claim(session, found)
            result = act(session)
        except BaseException:
            if found is not None and found.lease is not None and (session is None or session.lease == found.lease):
                if session is not None:
                    session.lease = None
                self.registry.give_back_lease(found.session_id, found.lease)
            raise
        return _Queued(result, self.worker.submit(result.op, result.run)) if isinstance(result, StoreStep) else result

    def run_store_step(self, step: StoreStep) -> Future:
        """Queue the step on the store thread now (in order with what the caller queues next), then settle it
        on the engine thread; the future has the settled answer."""
        stored = self.worker.submit(step.op, step.run)
        return asyncio.run_coroutine_threadsafe(self._settle(step, stored), self._loop)

    async def _settle(self, step: StoreStep, stored: Future) -> object:
        error, result = None, None
        try:
            result = await asyncio.wrap_future(stored)
        except Exception as failure:  # noqa: BLE001 - the settle decides what the caller hears
            error = failure
        if step.settle is None:  # a read (a listing): nothing to undo
            if error is not None:
                raise store_failure(error, "the sessions could not be listed")
            return result
        return await asyncio.wrap_future(self._internal_call(lambda: step.settle(error, result)))

    def close(self, timeout: float = 10.0) -> None:
        """After the store worker has closed: let the commands still settling finish, then stop their loop."""
        async def drain() -> None:
            pending = asyncio.all_tasks() - {asyncio.current_task()}
            if pending:
                await asyncio.wait(pending, timeout=timeout)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout + 1)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout)
                if not self._thread.is_alive():
                    self._loop.close()


@dataclass(frozen=True)
class _Queued:
    """An act's StoreStep, already queued on the store thread (from the engine thread)."""

    step: StoreStep
    stored: Future


def _done(result: object) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
