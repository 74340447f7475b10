"""The tier below host memory: sessions persisted as whole records (snapshot + kept turns + owner).

`SessionStore` is the interface (put / get / delete / expired / count, each a whole record as bytes);
`DirStore` keeps one file per session, written atomically (temp file, fsync, rename), so a crash never
leaves a torn record; `RedisStore` one key per session with the session TTL as its expiry. `StoreWriter`
is the thread that encodes and writes records off the engine's hot path: the engine hands it immutable
copies at the end of every turn and never waits for the disk.

A shared store (`shared = True`: Redis) is used by several replicas at once. It adds a revision per record
(a replica compares it with its in-memory copy before using that copy) and a per-session lease (SET NX
with expiry, renewed while generating, released once the turn's record is written): one writer per
session across all replicas.
"""

from __future__ import annotations

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

    def put(self, session_id: str, data: bytes, revision: str = "") -> None: ...
    def get(self, session_id: str) -> bytes | None: ...
    def delete(self, session_id: str) -> None: ...
    def expired(self, ttl_s: float) -> list[str]: ...
    def count(self) -> int: ...


class DirStore:
    """`dir:PATH` — one `<id>.lsess` file per session (one process per directory)."""

    shared = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _file(self, session_id: str) -> Path | None:
        return self.path / f"{session_id}{SUFFIX}" if SESSION_ID.fullmatch(session_id) else None

    def put(self, session_id: str, data: bytes, revision: str = "") -> None:
        target = self._file(session_id)
        if target is None:
            raise ValueError(f"not a session id: {session_id!r}")
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

    def delete(self, session_id: str) -> None:
        target = self._file(session_id)
        if target is not None:
            target.unlink(missing_ok=True)

    def expired(self, ttl_s: float) -> list[str]:
        cutoff = time.time() - ttl_s
        return [f.name[: -len(SUFFIX)] for f in self.path.glob(f"*{SUFFIX}") if f.stat().st_mtime < cutoff]

    def count(self) -> int:
        return sum(1 for _ in self.path.glob(f"*{SUFFIX}"))


class RedisStore:
    """`redis://HOST:PORT/DB` — one key per session, expiring `ttl_s` after its last write (Redis expires
    them itself). Errors propagate: a load answers 503, a failed write is logged and counted."""

    PREFIX = "linserve:session:"
    REVISION = "linserve:revision:"
    LEASE = "linserve:lease:"
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

    def put(self, session_id: str, data: bytes, revision: str = "") -> None:
        key = self._key(session_id)
        if key is None:
            raise ValueError(f"not a session id: {session_id!r}")
        with self.client.pipeline(transaction=True) as pipe:  # MULTI/EXEC: record, revision and expiry together
            pipe.set(key, data, px=self.ttl_ms)
            pipe.set(self.REVISION + session_id, revision, px=self.ttl_ms)
            pipe.execute()

    def get(self, session_id: str) -> bytes | None:
        key = self._key(session_id)
        return None if key is None else self.client.get(key)

    def revision(self, session_id: str) -> str | None:
        """The revision of the stored record (None: no record)."""
        key = self._key(session_id, self.REVISION)
        value = None if key is None else self.client.get(key)
        return None if value is None else value.decode()

    def delete(self, session_id: str) -> None:
        key = self._key(session_id)
        if key is not None:
            self.client.delete(key, self.REVISION + session_id)

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

    def put(self, session_id: str, encode: Callable[[], bytes], revision: str = "",
            done: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
        """Queue a write; `done` runs once it is written (not after a failed write), `after` either way."""
        self._queue.put(("put", session_id, lambda: self.store.put(session_id, encode(), revision), done, after))

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the writer thread after everything queued so far (e.g. a lease release)."""
        self._queue.put(("call", "a lease", fn, None, None))

    def delete(self, session_id: str, done: Callable[[], None] | None = None) -> None:
        """Queue a delete (after any queued write of the same session); `done` runs once it is done."""
        self._queue.put(("delete", session_id, lambda: self.store.delete(session_id), done, None))

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
