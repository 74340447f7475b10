"""What the session registry does between steps (engine thread): sessions idle past their TTL leave memory,
the leases this replica holds on a shared store are renewed, and the store is swept on its own thread — its
expired records removed, its records counted and (a store of this process alone) the records of sessions held
here that vanished from it found, to be written back (its directory removed and made again)."""

from __future__ import annotations

import logging
import time

from .leases import LEASE_RENEW_S
from .records import Session
from .stores import BrokenRecord, SessionStore
from .worker import StoreStep

logger = logging.getLogger(__name__)

EXPIRY_CHECK_INTERVAL_S = 1.0
STORE_SWEEP_INTERVAL_S = 10.0


class Upkeep:
    def __init__(self, registry) -> None:
        self.registry = registry
        self._last_expiry = 0.0
        self._last_renew = 0.0
        self._last_sweep = -STORE_SWEEP_INTERVAL_S
        self._sweeping = False
        self._store_was_up = True
        # store thread → engine thread: session ids whose records vanished (set by the service; see write_back)
        self.on_vanished = lambda session_ids: None

    def run(self) -> None:
        """Memory TTL, lease renewal, and the store's sweep handed to its thread."""
        registry = self.registry
        now = time.monotonic()
        if registry.shared and now - self._last_renew >= LEASE_RENEW_S:
            self._last_renew = now
            leases = [(s.id, s.lease) for s in registry.by_id.values() if s.lease is not None]
            if leases:
                registry.worker.submit("renew", lambda deadline: registry.access.renew(leases), None)
        if now - self._last_expiry < EXPIRY_CHECK_INTERVAL_S:
            return
        self._last_expiry = now
        for session in [s for s in registry.by_id.values() if not s.busy and now - s.last_used > registry.ttl_s]:
            registry._drop(session)  # with a store, its record stays until the store's own expiry below
        if not registry.store.keeps:
            return
        back = registry.worker.up and not self._store_was_up  # a store that comes back is checked at once
        self._store_was_up = registry.worker.up
        if not self._sweeping and (back or now - self._last_sweep >= STORE_SWEEP_INTERVAL_S):
            self._last_sweep, self._sweeping = now, True
            stored = [s.id for s in registry.by_id.values() if s.stored and not s.busy]
            registry.worker.submit("sweep", self._sweep_store(set(registry.by_id), stored), None)

    def _sweep_store(self, in_memory: set[str], stored: list[str]):
        """The store's expiry and count; and (a store of this process alone) the records of sessions held here
        that vanished from it — its directory removed and made again — handed to `on_vanished` to write back."""
        registry = self.registry
        store, ttl_s = registry.store, registry.ttl_s

        def sweep(deadline: float | None) -> None:
            try:
                for session_id in store.expired(ttl_s):
                    if session_id not in in_memory:
                        store.delete(session_id)
                registry.stored = store.count()
                vanished = [] if store.shared else [i for i in stored if _missing(store, i)]
                if vanished:
                    self.on_vanished(vanished)
            finally:
                self._sweeping = False

        return sweep

    def write_back(self, session_ids: list[str]) -> list[StoreStep]:
        """Engine thread: the records of these sessions (held here, idle, stored before) written again. On a
        shared store a missing record means another replica deleted the session: never written back there."""
        registry, steps = self.registry, []
        for session_id in session_ids:
            session = registry.by_id.get(session_id)
            if session is None or session.busy or not session.stored or registry.shared:
                continue
            logger.warning("session %s: its record vanished from the store; writing it back", session_id)
            steps.append(self._rewrite(session))
        return steps

    def _rewrite(self, session: Session) -> StoreStep:
        """A record written again; if that fails the session stays as it is here (the next sweep tries again)."""
        session.busy = True

        def settle(error: BaseException | None, _: object) -> None:
            session.busy = False
            if error is not None:
                logger.warning("session %s: writing its record back failed (%s); tried again at the next sweep",
                               session.id, error)

        return StoreStep("put", self.registry._record_write(session), settle)


def _missing(store: SessionStore, session_id: str) -> bool:
    try:
        return store.metadata(session_id) is None
    except BrokenRecord:
        return False  # there, though unreadable: not ours to overwrite
