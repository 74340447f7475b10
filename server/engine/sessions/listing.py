"""A caller's sessions, a page at a time: the ones in memory (device and host tiers) merged with the store's
owner index, in id order (= creation order), after a cursor.

Runs on the store worker's thread (after every write queued before it, so a session just created is in
the store) with a snapshot of the in-memory sessions taken on the engine thread: the engine never waits
for the store's I/O. Store-only sessions are described from their record's metadata, never read whole; a
record that cannot be read (torn, foreign bytes, a header declaring gigabytes, fields that are not
numbers) is skipped and reported to `on_skip`, never allowed to break the listing.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from .records import SessionInfo
from .stores import BrokenRecord, SessionStore, page_of


def store_info(session_id: str, metadata: dict[str, str], state_bytes: int) -> SessionInfo:
    """A store-only session described from its record's metadata (BrokenRecord if a field is malformed)."""
    try:
        created = float(metadata.get("created", 0.0))
        last_used = float(metadata.get("updated", created))
        tokens = int(metadata.get("tokens", 0))
    except ValueError:
        raise BrokenRecord("its metadata holds a malformed number") from None
    if not (math.isfinite(created) and math.isfinite(last_used) and tokens >= 0):
        raise BrokenRecord("its metadata holds an out-of-range number")
    return SessionInfo(id=session_id, tokens=tokens, state_bytes=state_bytes, tier="store", created=created,
                       last_used=last_used)


def list_sessions(memory: dict[str, SessionInfo], store: SessionStore | None, owner: str, after: str | None,
                  limit: int, descending: bool, state_bytes: int,
                  on_skip: Callable[[str, str], None] = lambda session_id, reason: None
                  ) -> tuple[list[SessionInfo], bool]:
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
            try:
                metadata = store.metadata(session_id)
                if metadata is None or metadata.get("owner", "") != owner:
                    store.unindex(session_id, owner)  # its record expired (or was never written): drop the entry
                    continue
                found.append(store_info(session_id, metadata, state_bytes))
            except BrokenRecord as broken:
                on_skip(session_id, str(broken))
        else:
            session_id = from_memory.popleft()
            if from_store and from_store[0] == session_id:
                from_store.popleft()
            found.append(memory[session_id])
    return found[:limit], len(found) > limit
