"""The tier below host memory: sessions persisted as whole records (snapshot + kept turns + owner).

`SessionStore` is the interface; `DirStore` keeps one file per session, `RedisStore` one key per session
with the session TTL as its expiry. Only the store worker's thread (`store_worker.py`) calls a store.

Durability: a write or delete either takes effect before its deadline or not at all. `DirStore` writes a
temporary file, fsyncs it, checks the deadline, renames it over the record and fsyncs the directory;
`RedisStore` runs each write as a Lua script that first compares Redis' own clock with the deadline, so a
command that reaches a frozen Redis and runs after it wakes up changes nothing. A caller that was told
"timed out" is therefore never contradicted later by a record that landed anyway.

Each store keeps an index of session ids per owner (`owned`: ids in order, after a cursor — session ids
begin with their creation time, so that is creation order) and reads a record's metadata alone
(`metadata`): listing never reads whole records. A shared store (`shared = True`: Redis) is used by
several replicas at once: a revision per record and a per-session lease (one writer across replicas).

Beside the records, two kinds of small entries: a session's own (`put_entry`: a stored response, kept for the
session's whole life — removed with it, expiring with it — within a byte budget per session), and keyed
results (`put_key`: what a create, fork, import or delete answered to an Idempotency-Key, for `ttl_s`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger(__name__)

SESSION_ID_PATTERN = r"sess-[0-9A-Za-z_-]{1,64}"  # the one pattern: routes, stores and listings use it
SESSION_ID = re.compile(SESSION_ID_PATTERN)
SUFFIX = ".lsess"
MAX_HEADER_BYTES = 16 * 2**20  # a record's safetensors header: far above any real one, never allocated blindly


ENTRY_NAME = re.compile(r"[0-9A-Za-z_:.-]{1,160}")  # a session entry's or a keyed result's name
ENTRY_TOTAL = "#bytes"  # (Redis) the field holding the bytes of a session's entries


class StoreTimeout(Exception):
    """A store call that did not finish before its deadline; it took no effect."""


class OutcomeUnknown(Exception):
    """A write or delete that reached the store but whose answer did not come back in time (a socket timeout
    or a connection lost after the command was sent, a call hung past its deadline): it may or may not have
    taken effect. The caller says so (`outcome_unknown`); the store is the truth from then on."""


class StoreUnavailable(Exception):
    """The store itself is missing or unusable (e.g. its directory was removed)."""


class BrokenRecord(Exception):
    """A record whose bytes are not a readable session record."""


class SessionStore(Protocol):
    """Every call may raise (the store is down): the worker turns that into a 503 for its caller.
    `deadline` is a unix time: a write or delete not done by then raises StoreTimeout and changes nothing."""

    shared: bool  # several processes use it at once: revisions and leases apply
    keeps: bool  # it keeps records (False: `none`, sessions live in this process only)
    kind: str  # "dir", "redis" or "none" (for /ready and logs)

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "",
            deadline: float | None = None) -> None: ...
    def get(self, session_id: str) -> bytes | None: ...
    def delete(self, session_id: str, owner: str | None = None, deadline: float | None = None) -> None: ...
    def expired(self, ttl_s: float) -> list[str]: ...
    def count(self) -> int: ...
    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]: ...
    def metadata(self, session_id: str) -> dict[str, str] | None: ...  # None: no record; BrokenRecord: unreadable
    def unindex(self, session_id: str, owner: str) -> None: ...
    def ping(self) -> None: ...  # raises unless the store can take writes now
    # a session's entries (False: its entries would pass `budget` bytes; nothing written) and keyed results
    def put_entry(self, session_id: str, name: str, data: bytes, budget: int,
                  deadline: float | None = None) -> bool: ...
    def get_entry(self, session_id: str, name: str) -> bytes | None: ...
    def delete_entry(self, session_id: str, name: str, deadline: float | None = None) -> None: ...
    def put_key(self, name: str, data: bytes, ttl_s: float) -> None: ...
    def get_key(self, name: str) -> bytes | None: ...
    # shared stores only
    def revision(self, session_id: str) -> str | None: ...
    def acquire(self, session_id: str, holder: str, lease_ms: int, deadline: float | None = None) -> bool: ...
    def renew(self, session_id: str, holder: str, lease_ms: int) -> bool: ...
    def release(self, session_id: str, holder: str) -> None: ...


def owner_key(owner: str | None) -> str:
    """A file- and key-safe name for an owner (an API key's id; empty: no key)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32] if owner else "anonymous"


def check_deadline(deadline: float | None, what: str) -> None:
    if deadline is not None and time.time() > deadline:
        raise StoreTimeout(f"the session store did not finish the {what} in time")


def header_metadata(read: Callable[[int, int], bytes]) -> dict[str, str] | None:
    """A safetensors record's metadata from its header alone; `read(start, length)` reads the record's bytes.
    None: no record. A record that is not safetensors, or declares a header larger than MAX_HEADER_BYTES,
    raises BrokenRecord without reading (or allocating) what it declares."""
    size = read(0, 8)
    if not size:
        return None
    length = int.from_bytes(size, "little") if len(size) == 8 else -1
    if not 0 < length <= MAX_HEADER_BYTES:
        raise BrokenRecord(f"declares a header of {length} bytes")
    try:
        header = json.loads(read(8, length))
        metadata = header.get("__metadata__") or {}
    except (ValueError, AttributeError, UnicodeDecodeError):
        raise BrokenRecord("its header is not a safetensors header") from None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BrokenRecord("its metadata is not a map of strings")
    return metadata


def page_of(ids: list[str], after: str | None, limit: int, descending: bool) -> list[str]:
    """Up to `limit` of the sorted `ids` that come after the cursor in the listing's order."""
    ordered = sorted(ids, reverse=descending)
    if after is not None:
        ordered = [i for i in ordered if (i < after if descending else i > after)]
    return ordered[:limit]


class NoStore:
    """`none` (and every softmax model): sessions live in this process only. It keeps nothing, so every change is
    acknowledged at once — the registry settles its store steps on the spot — and nothing is ever found in it."""

    shared, keeps, kind = False, False, "none"

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "",
            deadline: float | None = None) -> None:
        pass

    def get(self, session_id: str) -> bytes | None:
        return None

    def delete(self, session_id: str, owner: str | None = None, deadline: float | None = None) -> None:
        pass

    def expired(self, ttl_s: float) -> list[str]:
        return []

    def count(self) -> int:
        return 0

    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]:
        return []

    def metadata(self, session_id: str) -> dict[str, str] | None:
        return None

    def unindex(self, session_id: str, owner: str) -> None:
        pass

    def ping(self) -> None:
        pass

    def put_entry(self, session_id: str, name: str, data: bytes, budget: int, deadline: float | None = None) -> bool:
        return False

    def get_entry(self, session_id: str, name: str) -> bytes | None:
        return None

    def delete_entry(self, session_id: str, name: str, deadline: float | None = None) -> None:
        pass

    def put_key(self, name: str, data: bytes, ttl_s: float) -> None:
        pass

    def get_key(self, name: str) -> bytes | None:
        return None
