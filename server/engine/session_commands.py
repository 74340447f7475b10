"""The engine's session methods (any thread): each enqueues a command for the engine thread and returns a
future. Mixed into `Engine`, which provides `_call`, `sessions` (the SessionManager), `store_writer` and `pool`.

Two ways a command's answer can wait on the session store:
- `_after_writes`: the answer is made on the store's writer thread once every write queued before it has
  landed — a new session is answered only when its record is stored (any replica finds the id it gets), and
  a listing reads a store that holds every session this replica has made. The engine never waits for I/O.
- `_call_leased`: retried for a moment while another replica holds the session's lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from .session_leases import LEASE_GRACE_S, LeaseHeld
from .session_listing import list_sessions


class SessionCommands:
    def create_session(self, owner: str | None) -> Future:
        return self._after_writes(lambda: self.sessions.create(owner))

    def session_info(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.info(self.sessions.get(session_id, owner)))

    def fork_session(self, session_id: str, owner: str | None) -> Future:
        return self._after_writes(lambda: self.sessions.fork(session_id, owner))

    def export_session(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.export(session_id, owner))

    def import_session(self, data: bytes, owner: str | None) -> Future:
        return self._after_writes(lambda: self.sessions.import_(data, owner))

    def session_turns(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.turns(session_id, owner))

    def rewind_session(self, session_id: str, owner: str | None, turn: int) -> Future:
        return self._call_leased(lambda: self.sessions.rewind(session_id, owner, turn))

    def delete_session(self, session_id: str, owner: str | None) -> Future:
        return self._call_leased(lambda: self.sessions.delete(session_id, owner))

    def list_sessions(self, owner: str | None, after: str | None, limit: int, descending: bool) -> Future:
        """(a page of the caller's sessions, whether more follow): the in-memory ones snapshotted on the engine
        thread, the store read after the queued writes (see session_listing)."""
        def page(memory: dict):
            return self.sessions.store_call(list_sessions, memory, self.sessions.store, owner or "", after, limit,
                                             descending, self.pool.slot_bytes)

        return self._after_writes(lambda: self.sessions.owned_infos(owner), page)

    # ------------------------------------------------------------------ how answers wait on the store
    def _after_writes(self, fn: Callable[[], object], then: Callable[[object], object] = lambda result: result) -> Future:
        """`fn` on the engine thread, then `then(its result)` on the store's writer thread after every write
        queued so far (at once, on the engine thread, without a store); the future gets what `then` returns."""
        outer: Future = Future()

        def finish(result: object) -> None:
            try:
                outer.set_result(then(result))
            except Exception as error:  # noqa: BLE001 - handed to the caller (an EngineError from the store)
                outer.set_exception(error)

        def settle(inner: Future) -> None:
            if inner.exception() is not None:
                outer.set_exception(inner.exception())
            elif self.store_writer is None:
                finish(inner.result())
            else:
                self.store_writer.call(lambda: finish(inner.result()))

        self._call(fn).add_done_callback(settle)
        return outer

    def _call_leased(self, fn: Callable[[], object]) -> Future:
        """`_call`, retried for up to LEASE_GRACE_S while another replica holds the session's lease: the
        lease outlives a finished turn until its record is written (milliseconds), and a client that
        moves on to another replica at once must not get a 409 for that."""
        outer: Future = Future()
        deadline = time.monotonic() + LEASE_GRACE_S

        def attempt() -> None:
            self._call(fn).add_done_callback(settle)

        def settle(inner: Future) -> None:
            error = inner.exception()
            if isinstance(error, LeaseHeld) and time.monotonic() < deadline:
                timer = threading.Timer(0.02, attempt)
                timer.daemon = True
                timer.start()
            elif error is not None:
                outer.set_exception(error)
            else:
                outer.set_result(inner.result())

        attempt()
        return outer

