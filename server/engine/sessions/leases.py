"""What a session command needs from the store before the engine thread acts on it, fetched on the store
worker's thread: the record (when this process has no copy, or its copy is stale), the record's revision
(shared stores: another replica may have changed it) and, for a command that changes the session on a
shared store, its lease (one writer across replicas).

`StoreAccess.lookup` runs on the store thread and returns a `Lookup`; the engine thread then decides with
it (`SessionManager.resolve`). Nothing here runs on the engine thread.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from ..types import EngineError
from .stores import SessionStore, StoreTimeout

logger = logging.getLogger(__name__)

LEASE_MS = 10_000  # a replica that dies mid-turn blocks its session at most this long (renewed while alive)
LEASE_RENEW_S = LEASE_MS / 3000  # renewed three times per lease while generating
LEASE_GRACE_S = 0.5  # a lease held by a turn finishing elsewhere is waited for this long before a 409
MAX_UNRELEASED = 10_000  # releases kept for retry (each a few bytes); beyond that the oldest just expire


class LeaseHeld(EngineError):
    """Another replica holds the session's lease (it is generating, or its last write is in flight)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is generating on another replica", kind="busy", param="session_id")


@dataclass(frozen=True)
class Lookup:
    session_id: str
    lease: str | None  # the lease token taken for this command (shared store, a command that changes it)
    revision: str | None  # the stored record's revision (shared store; None: no record)
    data: bytes | None  # the record, if fetched
    fetched: bool  # whether `data` was read (False: this process's copy was current when looked up)


class StoreAccess:
    """Store-thread side of session commands. `local(session_id)` tells what this process holds: None, or
    the revision of its in-memory copy (read across threads: a hint that the engine thread re-checks)."""

    def __init__(self, store: SessionStore, local: Callable[[str], tuple[bool, str | None]]) -> None:
        self.store = store
        self.shared = store.shared
        self.local = local
        self.replica = uuid.uuid4().hex  # this process's name, the first half of every lease token it takes
        # leases whose release failed (the store was down), every token of each session: retried as soon as the
        # store answers — by the worker's next successful probe, or by the next claim of the same session — not
        # left to expire. A set per session: a claim that fails during the outage adds its token (the store may
        # have granted it) beside the one the store surely holds, never in its place
        self.unreleased: dict[str, set[str]] = {}
        self.undone: dict[str, str] = {}  # new sessions whose record must not stay (their create failed): owner

    def lookup(self, session_id: str, claim: bool, refetch: bool, deadline: float | None) -> Lookup:
        lease = None
        if claim and self.shared:
            for kept in self.unreleased.pop(session_id, ()):  # our own leases, kept by failed releases: first
                self.release(session_id, kept)  # (one that fails again stays kept)
            lease = f"{self.replica}:{uuid.uuid4().hex[:12]}"  # one per claim: a late release can't free a newer one
            try:
                acquired = self.store.acquire(session_id, lease, LEASE_MS, deadline)
            except StoreTimeout:
                raise  # Redis ran it too late: it took no lease
            except Exception:  # the answer was lost: it may hold the lease; release it when the store answers
                self._keep(session_id, lease)
                raise
            if not acquired:
                raise LeaseHeld(session_id)
        try:
            revision = self.store.revision(session_id) if self.shared else None
            held, local_revision = self.local(session_id)
            fetch = refetch or not held or (self.shared and local_revision != revision)
            data = self.store.get(session_id) if fetch else None
        except BaseException:
            if lease is not None:
                self.release(session_id, lease)
            raise
        return Lookup(session_id, lease, revision, data, fetch)

    def release(self, session_id: str, lease: str) -> bool:
        """Give the lease back (whether the store took it); a failure is kept and retried (`retry_releases`)."""
        try:
            self.store.release(session_id, lease)
            return True
        except Exception:  # noqa: BLE001 - retried when the store answers; it expires by itself after LEASE_MS
            if session_id not in self.unreleased:
                logger.warning("releasing the lease of %s failed; retried when the store answers (it expires "
                               "in %d ms regardless)", session_id, LEASE_MS)
            self._keep(session_id, lease)
            return False

    def _keep(self, session_id: str, lease: str) -> None:
        if session_id not in self.unreleased and len(self.unreleased) >= MAX_UNRELEASED:
            self.unreleased.pop(next(iter(self.unreleased)))
        self.unreleased.setdefault(session_id, set()).add(lease)

    def undo(self, session_id: str, owner: str) -> None:
        """Remove a new session's record that may have landed after its create failed (kept and retried with
        the leases until the store answers)."""
        try:
            self.store.delete(session_id, owner)
        except Exception:  # noqa: BLE001 - retried when the store answers
            if len(self.undone) < MAX_UNRELEASED:
                self.undone[session_id] = owner

    def retry_releases(self, deadline: float | None = None) -> None:
        """Store thread, after a successful probe: give back the leases whose release failed, and remove the
        records of creates that failed with an unknown outcome (stops at the first failure: the store is not
        answering after all)."""
        while self.undone:
            session_id, owner = next(iter(self.undone.items()))
            del self.undone[session_id]
            self.undo(session_id, owner)
            if session_id in self.undone:
                return
        while self.unreleased:
            session_id, leases = next(iter(self.unreleased.items()))
            del self.unreleased[session_id]
            if not all([self.release(session_id, lease) for lease in leases]):  # a list: every token tried
                return
            logger.info("released the lease of %s that the store missed", session_id)

    def renew(self, leases: list[tuple[str, str]]) -> None:
        for session_id, lease in leases:
            try:
                self.store.renew(session_id, lease, LEASE_MS)
            except Exception:  # noqa: BLE001 - retried next time; the lease outlives a few misses
                logger.warning("renewing the lease of %s failed", session_id)
