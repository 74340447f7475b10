"""The tier below host memory: sessions persisted as whole records (snapshot + kept turns + owner).

`SessionStore` is the interface (put / get / delete / expired / count, each a whole record as bytes);
`DirStore` keeps one file per session, written atomically (temp file, fsync, rename), so a crash never
leaves a torn record; `RedisStore` one key per session with the session TTL as its expiry. `StoreWriter`
is the thread that encodes and writes records off the engine's hot path: the engine hands it immutable
copies at the end of every turn and never waits for the disk.

Each store also keeps an index of session ids per owner (`owned`: ids in order, after a cursor — session
ids begin with their creation time, so that is creation order) and reads a record's metadata alone
(`metadata`): listing a caller's sessions never reads whole records. An index entry whose record is gone
(expired) is dropped when a listing meets it.

A shared store (`shared = True`: Redis) is used by several replicas at once. It adds a revision per record
(a replica compares it with its in-memory copy before using that copy) and a per-session lease (SET NX
with expiry, renewed while generating, released once the turn's record is written): one writer per
session across all replicas.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

SESSION_ID = re.compile(r"sess-[0-9A-Za-z_-]{1,64}")
SUFFIX = ".lsess"


class SessionStore(Protocol):
    shared: bool  # several processes use it at once: revisions and leases apply

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "") -> None: ...
    def get(self, session_id: str) -> bytes | None: ...
    def delete(self, session_id: str, owner: str | None = None) -> None: ...  # owner None: read from the record
    def expired(self, ttl_s: float) -> list[str]: ...
    def count(self) -> int: ...
    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]: ...
    def metadata(self, session_id: str) -> dict[str, str] | None: ...
    def unindex(self, session_id: str, owner: str) -> None: ...


def owner_key(owner: str | None) -> str:
    """A file- and key-safe name for an owner (an API key's id; empty: no key)."""
    return hashlib.sha256(owner.encode()).hexdigest()[:32] if owner else "anonymous"


def header_metadata(read: Callable[[int, int], bytes]) -> dict[str, str] | None:
    """A safetensors record's metadata from its header alone; `read(start, length)` reads the record's bytes."""
    size = read(0, 8)
    if len(size) < 8:
        return None
    length = int.from_bytes(size, "little")
    try:
        header = json.loads(read(8, length))
    except ValueError:
        return None
    return header.get("__metadata__") or {} if isinstance(header, dict) else None


def page_of(ids: list[str], after: str | None, limit: int, descending: bool) -> list[str]:
    """Up to `limit` of the sorted `ids` that come after the cursor in the listing's order."""
    ordered = sorted(ids, reverse=descending)
    if after is not None:
        ordered = [i for i in ordered if (i < after if descending else i > after)]
    return ordered[:limit]


class DirStore:
    """`dir:PATH` — one `<id>.lsess` file per session (one process per directory)."""

    shared = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.owners = self.path / "owners"  # owners/<owner key>/<session id>: empty files, the owner index
        if not self.owners.is_dir():
            self._build_index()

    def _file(self, session_id: str) -> Path | None:
        return self.path / f"{session_id}{SUFFIX}" if SESSION_ID.fullmatch(session_id) else None

    def _build_index(self) -> None:
        """The owner index of a directory written before it existed (or with its index removed)."""
        for record in self.path.glob(f"*{SUFFIX}"):
            session_id = record.name[: -len(SUFFIX)]
            metadata = self.metadata(session_id)
            if metadata is not None:
                self._index(session_id, metadata.get("owner", ""))
        self.owners.mkdir(exist_ok=True)

    def _index(self, session_id: str, owner: str) -> None:
        entry = self.owners / owner_key(owner) / session_id
        if not entry.exists():
            entry.parent.mkdir(parents=True, exist_ok=True)
            entry.touch()

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "") -> None:
        target = self._file(session_id)
        if target is None:
            raise ValueError(f"not a session id: {session_id!r}")
        self._index(session_id, owner)  # first: a record is never without its entry
        temporary = self.path / f".{session_id}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)  # atomic: readers see the old record or the new one, never half

    def get(self, session_id: str) -> bytes | None:
        target = self._file(session_id)
        try:
            return target.read_bytes() if target is not None else None
        except FileNotFoundError:
            return None

    def delete(self, session_id: str, owner: str | None = None) -> None:
        target = self._file(session_id)
        if target is None:
            return
        if owner is None:
            owner = (self.metadata(session_id) or {}).get("owner")
        target.unlink(missing_ok=True)
        if owner is not None:
            self.unindex(session_id, owner)

    def unindex(self, session_id: str, owner: str) -> None:
        if SESSION_ID.fullmatch(session_id):
            (self.owners / owner_key(owner) / session_id).unlink(missing_ok=True)

    def expired(self, ttl_s: float) -> list[str]:
        cutoff = time.time() - ttl_s
        return [f.name[: -len(SUFFIX)] for f in self.path.glob(f"*{SUFFIX}") if f.stat().st_mtime < cutoff]

    def count(self) -> int:
        return sum(1 for _ in self.path.glob(f"*{SUFFIX}"))

    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]:
        try:
            ids = os.listdir(self.owners / owner_key(owner))
        except FileNotFoundError:
            return []
        return page_of(ids, after, limit, descending)

    def metadata(self, session_id: str) -> dict[str, str] | None:
        target = self._file(session_id)
        if target is None:
            return None
        try:
            with open(target, "rb") as record:
                def read(start: int, length: int) -> bytes:
                    record.seek(start)
                    return record.read(length)

                return header_metadata(read)
        except FileNotFoundError:
            return None


class RedisStore:
    """`redis://HOST:PORT/DB` — one key per session, expiring `ttl_s` after its last write (Redis expires
    them itself). Errors propagate: a load answers 503, a failed write is logged and counted."""

    PREFIX = "linserve:session:"
    REVISION = "linserve:revision:"
    LEASE = "linserve:lease:"
    OWNER = "linserve:owner:"  # a sorted set of session ids per owner (score 0: ordered by id)
    shared = True
    # compare-and-act on a lease: only its holder may renew or release it
    _RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
    _RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"

    def __init__(self, url: str, ttl_s: float) -> None:
        import redis  # only needed for this store

        self.client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self._renew = self.client.register_script(self._RENEW)
        self._release = self.client.register_script(self._RELEASE)

    def _key(self, session_id: str, prefix: str = PREFIX) -> str | None:
        return prefix + session_id if SESSION_ID.fullmatch(session_id) else None

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "") -> None:
        key = self._key(session_id)
        if key is None:
            raise ValueError(f"not a session id: {session_id!r}")
        index = self.OWNER + owner_key(owner)
        with self.client.pipeline(transaction=True) as pipe:  # MULTI/EXEC: record, revision, index and expiry
            pipe.set(key, data, px=self.ttl_ms)
            pipe.set(self.REVISION + session_id, revision, px=self.ttl_ms)
            pipe.zadd(index, {session_id: 0})
            # the index lives as long as its longest-lived record: set on a new index, else only extended
            pipe.pexpire(index, self.ttl_ms, nx=True)
            pipe.pexpire(index, self.ttl_ms, gt=True)
            pipe.execute()

    def get(self, session_id: str) -> bytes | None:
        key = self._key(session_id)
        return None if key is None else self.client.get(key)

    def revision(self, session_id: str) -> str | None:
        """The revision of the stored record (None: no record)."""
        key = self._key(session_id, self.REVISION)
        value = None if key is None else self.client.get(key)
        return None if value is None else value.decode()

    def delete(self, session_id: str, owner: str | None = None) -> None:
        key = self._key(session_id)
        if key is None:
            return
        if owner is None:
            owner = (self.metadata(session_id) or {}).get("owner")
        self.client.delete(key, self.REVISION + session_id)
        if owner is not None:
            self.unindex(session_id, owner)

    def unindex(self, session_id: str, owner: str) -> None:
        self.client.zrem(self.OWNER + owner_key(owner), session_id)

    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]:
        index = self.OWNER + owner_key(owner)
        if descending:
            ids = self.client.zrevrangebylex(index, "+" if after is None else f"({after}", "-", start=0, num=limit)
        else:
            ids = self.client.zrangebylex(index, "-" if after is None else f"({after}", "+", start=0, num=limit)
        return [i.decode() for i in ids]

    def metadata(self, session_id: str) -> dict[str, str] | None:
        key = self._key(session_id)
        if key is None:
            return None
        return header_metadata(lambda start, length: self.client.getrange(key, start, start + length - 1))

    def acquire(self, session_id: str, holder: str, lease_ms: int) -> bool:
        key = self._key(session_id, self.LEASE)
        return key is not None and bool(self.client.set(key, holder, nx=True, px=lease_ms))

    def renew(self, session_id: str, holder: str, lease_ms: int) -> bool:
        return bool(self._renew(keys=[self.LEASE + session_id], args=[holder, lease_ms]))

    def release(self, session_id: str, holder: str) -> None:
        self._release(keys=[self.LEASE + session_id], args=[holder])

    def expired(self, ttl_s: float) -> list[str]:
        return []  # Redis expires keys by itself

    def count(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.PREFIX + "*", count=1000))


def open_store(spec: str, ttl_s: float = 3600.0) -> SessionStore | None:
    """`none`, `dir:PATH` or `redis://HOST:PORT/DB`."""
    if spec == "none":
        return None
    if spec.startswith("dir:") and len(spec) > 4:
        return DirStore(spec[4:])
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, ttl_s)
    raise ValueError(f"session_store must be 'none', 'dir:PATH' or 'redis://HOST:PORT/DB', got {spec!r}")


class StoreWriter:
    """One thread that runs store writes in order: `put(id, encode)` encodes there, not on the caller."""

    def __init__(self, store: SessionStore, on_result: Callable[[str, bool, float], None] | None = None) -> None:
        self.store = store
        self.on_result = on_result or (lambda op, ok, seconds: None)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="linserve-session-store", daemon=True)
        self._thread.start()

    def put(self, session_id: str, encode: Callable[[], bytes], revision: str = "", owner: str = "",
            done: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        """Queue a write; `done` runs once it is written (not after a failed write), `after` either way."""
        self._queue.put(("put", session_id, lambda: self.store.put(session_id, encode(), revision, owner), done, after))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the writer thread after everything queued so far (e.g. a lease release)."""
        self._queue.put(("call", "a lease", fn, None, None))

    def delete(self, session_id: str, done: Callable[[], None] | None = None, owner: str | None = None) -> None:
        """Queue a delete (after any queued write of the same session); `done` runs once it is done."""
        self._queue.put(("delete", session_id, lambda: self.store.delete(session_id, owner), done, None))

    def flush(self) -> None:
        """Wait until everything handed over so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.flush()
        self._queue.put(None)
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                op, session_id, work, done, after = item
                started = time.perf_counter()
                try:
                    work()
                    if done is not None:
                        done()  # only after success: a failed write keeps its lease/tombstone until it expires
                    ok = True
                except Exception:  # noqa: BLE001 - a failed write is logged and counted; serving goes on
                    logger.exception("session store %s of %s failed", op, session_id)
                    ok = False
                if after is not None:
                    after()
                if op != "call":
                    self.on_result(op, ok, time.perf_counter() - started)
            finally:
                self._queue.task_done()
