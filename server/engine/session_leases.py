"""Sessions on a store shared by several replicas (Redis): the per-session lease (one writer across
replicas) and the freshness check of in-memory copies. Mixed into `SessionManager`; engine thread only."""

from __future__ import annotations

import logging
import time
import uuid

from .sessions import Session
from .types import EngineError

logger = logging.getLogger(__name__)

LEASE_MS = 30_000  # a replica that dies mid-turn blocks its session at most this long
LEASE_RENEW_S = LEASE_MS / 3000  # renewed three times per lease while generating
LEASE_GRACE_S = 0.5  # a lease still held for a turn's write in flight is waited for this long before 409


class LeaseHeld(EngineError):
    """Another replica holds the session's lease (it is generating, or its last write is in flight)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is generating on another replica", kind="busy", param="session_id")


class SharedStoreAccess:
    """Needs from its host class: store, writer, shared, replica, sessions, _unwritten(_lock), _last_renew,
    and the methods _idle (lookup with the freshness check) and _drop."""

    def store_call(self, fn, *args):
        """`fn(*args)` against the store; any failure is the 503-kind EngineError "store unavailable"."""
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - the store is down: say so, stateless work goes on
            raise EngineError(f"the session store is unavailable ({error.__class__.__name__})", kind="unavailable") from None

    def _fresh(self, session: Session) -> Session | None:
        """Shared store: the in-memory copy if it is still the newest, else None (dropped; another replica
        advanced, rewound or deleted the session). Our own queued writes make ours the newest."""
        with self._unwritten_lock:
            if self._unwritten[session.id]:
                return session
        if self.store_call(self.store.revision, session.id) == session.revision:
            return session
        self._drop(session)
        return None

    # ---- leases (shared store: one writer per session across replicas) ----
    def _claim(self, session_id: str, owner: str | None) -> Session:
        """The idle session, leased to this replica; 409 if another replica holds the lease. Shared store:
        the copy is checked (or loaded) under the lease, so it is what the last holder wrote."""
        if not self.shared:
            return self._idle(session_id, owner)
        local = self.sessions.get(session_id)
        if local is not None and local.busy:  # generating here: this replica's own lease is the one held
            return self._idle(session_id, owner)  # raises "is generating"
        token = f"{self.replica}:{uuid.uuid4().hex[:12]}"  # one per claim: a late release can't free a newer one
        if not self.store_call(self.store.acquire, session_id, token, LEASE_MS):
            raise LeaseHeld(session_id)
        try:
            session = self._idle(session_id, owner)
        except EngineError:
            self.writer.call(lambda: self.store.release(session_id, token))
            raise
        session.lease = token
        return session

    def _take_lease(self, session: Session):
        """Hand over the session's lease: returns the call that releases it (None if it holds none)."""
        if session.lease is None:
            return None
        session_id, store, token = session.id, self.store, session.lease
        session.lease = None
        return lambda: store.release(session_id, token)

    def _release_lease(self, session: Session) -> None:
        release = self._take_lease(session)
        if release is not None:
            self.writer.call(release)  # after any write queued before it

    def renew_leases(self) -> None:
        now = time.monotonic()
        if not self.shared or now - self._last_renew < LEASE_RENEW_S:
            return
        self._last_renew = now
        for session in [s for s in self.sessions.values() if s.lease is not None]:
            try:
                self.store.renew(session.id, session.lease, LEASE_MS)
            except Exception:  # noqa: BLE001 - retried next time; the lease outlives a few misses
                logger.warning("renewing the lease of %s failed", session.id)
