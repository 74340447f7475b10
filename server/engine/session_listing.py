"""A caller's sessions, a page at a time: the ones in memory (device and host tiers) merged with the store's
owner index, in id order (= creation order), after a cursor.

Runs on the store's writer thread (after every write queued before it, so a session just created is in
the store) with a snapshot of the in-memory sessions taken on the engine thread: the engine never waits
for the store's I/O. Store-only sessions are described from their record's metadata, never read whole.
"""

from __future__ import annotations

from collections import deque

from .session_store import SessionStore, page_of
from .sessions import SessionInfo


def store_info(session_id: str, metadata: dict[str, str], state_bytes: int) -> SessionInfo:
    created = float(metadata.get("created", 0.0))
    return SessionInfo(id=session_id, tokens=int(metadata.get("tokens", 0)), state_bytes=state_bytes, tier="store",
                       created=created, last_used=float(metadata.get("updated", created)))


def list_sessions(memory: dict[str, SessionInfo], store: SessionStore | None, owner: str, after: str | None,
                  limit: int, descending: bool, state_bytes: int) -> tuple[list[SessionInfo], bool]:
    """(up to `limit` sessions, whether more follow). A shared store (replicas) is the list: this replica's
    memory only describes the sessions it holds. Otherwise memory adds sessions whose record is not written."""
    from_memory = deque(page_of(list(memory), after, limit + 1, descending)
                        if store is None or not store.shared else [])
    from_store: deque[str] = deque()
    store_cursor, store_done = after, store is None
    found: list[SessionInfo] = []

    def first(a: str, b: str) -> bool:
        return a > b if descending else a < b

    while len(found) <= limit:
        if not from_store and not store_done:
            batch = store.owned(owner, store_cursor, limit + 1, descending)
            store_done = len(batch) < limit + 1
            store_cursor = batch[-1] if batch else store_cursor
            from_store.extend(batch)
        if not from_store and not from_memory:
            break
        if from_store and (not from_memory or first(from_store[0], from_memory[0])):
            session_id = from_store.popleft()
            if session_id in memory:
                found.append(memory[session_id])
                continue
            metadata = store.metadata(session_id)
            if metadata is None or metadata.get("owner", "") != owner:
                store.unindex(session_id, owner)  # its record expired (or was never written): drop the entry
                continue
            found.append(store_info(session_id, metadata, state_bytes))
        else:
            session_id = from_memory.popleft()
            if from_store and from_store[0] == session_id:
                from_store.popleft()
            found.append(memory[session_id])
    return found[:limit], len(found) > limit
