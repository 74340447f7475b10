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
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
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
    kind: str  # "dir" or "redis" (for /ready and logs)

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


class DirStore:
    """`dir:PATH` — one `<id>.lsess` file per session (one process per directory)."""

    shared = False
    kind = "dir"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.owners = self.path / "owners"  # owners/<owner key>/<session id>: empty files, the owner index
        self.entries = self.path / "entries"  # entries/<session id>/<name>: a session's entries
        self.keys = self.path / "keys"  # keys/<name>: keyed results (their expiry inside)
        self._sweep()
        self._ensure_layout()

    def _sweep(self) -> None:
        """What a process killed mid-write leaves (one process per directory, so at start-up nothing else is
        writing): record and probe files never renamed into place, and owner indexes never finished."""
        for leftover in self.path.glob(".*"):
            name = leftover.name
            try:
                if name.startswith(".owners.") and leftover.is_dir():
                    shutil.rmtree(leftover)
                elif name.endswith(".tmp") or name.startswith(".probe."):
                    leftover.unlink()
                else:
                    continue  # not ours: left alone, and not reported
            except FileNotFoundError:
                continue
            logger.info("session store: removed %s, left by an interrupted write", name)

    def _ensure_layout(self) -> None:
        """The owner index, built when it is missing — at the first start, or after the directory was removed
        and made again under a running server (its writes then work again at once, not never)."""
        if not self.owners.is_dir():
            if not self.path.is_dir():
                raise self._missing()
            self._build_index()

    def _file(self, session_id: str) -> Path | None:
        return self.path / f"{session_id}{SUFFIX}" if SESSION_ID.fullmatch(session_id) else None

    def _build_index(self) -> None:
        """The owner index of a directory written before it existed (or with its index removed): built
        aside, then renamed into place, so an interrupted build is redone at the next start."""
        building = self.path / f".owners.{uuid.uuid4().hex}"
        building.mkdir()
        for record in self.path.glob(f"*{SUFFIX}"):
            session_id = record.name[: -len(SUFFIX)]
            try:
                metadata = self.metadata(session_id)
            except BrokenRecord:
                continue
            if metadata is not None:
                self._index(session_id, metadata.get("owner", ""), building)
        building.rename(self.owners)

    def _index(self, session_id: str, owner: str, owners: Path | None = None) -> None:
        entry = (owners or self.owners) / owner_key(owner) / session_id
        if not entry.exists():
            entry.parent.mkdir(exist_ok=True)  # never parents: a removed store directory is not made again
            entry.touch()

    def _sync_directory(self) -> None:
        """The rename or unlink itself is durable only once the directory is fsync'd."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _missing(self) -> StoreUnavailable:
        return StoreUnavailable(f"the session store directory {self.path} is missing")

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "",
            deadline: float | None = None) -> None:
        target = self._file(session_id)
        if target is None:
            raise ValueError(f"not a session id: {session_id!r}")
        self._ensure_layout()
        self._index(session_id, owner)  # first: a record is never without its entry
        temporary = self.path / f".{session_id}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            check_deadline(deadline, "write")
            os.replace(temporary, target)  # atomic: readers see the old record or the new one, never half
        except BaseException:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
            raise
        self._sync_directory()

    def get(self, session_id: str) -> bytes | None:
        target = self._file(session_id)
        if target is None:
            return None
        try:
            return target.read_bytes()
        except FileNotFoundError:
            if not self.path.is_dir():
                raise self._missing() from None
            return None

    def delete(self, session_id: str, owner: str | None = None, deadline: float | None = None) -> None:
        target = self._file(session_id)
        if target is None:
            return
        if not self.path.is_dir():
            raise self._missing()
        if owner is None:
            try:
                owner = (self.metadata(session_id) or {}).get("owner")
            except BrokenRecord:
                owner = None
        check_deadline(deadline, "delete")
        target.unlink(missing_ok=True)
        self._sync_directory()
        shutil.rmtree(self.entries / session_id, ignore_errors=True)
        if owner is not None:
            self.unindex(session_id, owner)

    def unindex(self, session_id: str, owner: str) -> None:
        if SESSION_ID.fullmatch(session_id):
            (self.owners / owner_key(owner) / session_id).unlink(missing_ok=True)

    def _write_file(self, target: Path, data: bytes, deadline: float | None) -> None:
        temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            check_deadline(deadline, "write")
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def _entry(self, session_id: str, name: str) -> Path:
        if not (SESSION_ID.fullmatch(session_id) and ENTRY_NAME.fullmatch(name)):
            raise ValueError(f"not a session entry: {session_id!r} / {name!r}")
        return self.entries / session_id / name

    def put_entry(self, session_id: str, name: str, data: bytes, budget: int,
                  deadline: float | None = None) -> bool:
        target = self._entry(session_id, name)
        self._ensure_layout()
        self.entries.mkdir(exist_ok=True)
        target.parent.mkdir(exist_ok=True)
        sizes = {f.name: f.stat().st_size for f in target.parent.iterdir() if not f.name.startswith(".")}
        if sum(sizes.values()) - sizes.get(name, 0) + len(data) > budget:
            return False
        self._write_file(target, data, deadline)
        return True

    def get_entry(self, session_id: str, name: str) -> bytes | None:
        try:
            return self._entry(session_id, name).read_bytes()
        except (FileNotFoundError, ValueError):
            return None

    def delete_entry(self, session_id: str, name: str, deadline: float | None = None) -> None:
        check_deadline(deadline, "delete")
        self._entry(session_id, name).unlink(missing_ok=True)

    def put_key(self, name: str, data: bytes, ttl_s: float) -> None:
        if not ENTRY_NAME.fullmatch(name):
            raise ValueError(f"not a key: {name!r}")
        self._ensure_layout()
        self.keys.mkdir(exist_ok=True)
        self._write_file(self.keys / name, json.dumps({"expires": time.time() + ttl_s}).encode() + b"\n" + data, None)

    def get_key(self, name: str) -> bytes | None:
        try:
            head, _, data = (self.keys / name).read_bytes().partition(b"\n")
        except (FileNotFoundError, OSError):
            return None
        return data if ENTRY_NAME.fullmatch(name) and json.loads(head)["expires"] > time.time() else None

    def _prune(self) -> None:
        """Entries of sessions without a record, and keyed results past their expiry (the sweep's)."""
        for folder in self.entries.iterdir() if self.entries.is_dir() else ():
            if self._file(folder.name) is not None and not self._file(folder.name).exists():
                shutil.rmtree(folder, ignore_errors=True)
        for key in self.keys.iterdir() if self.keys.is_dir() else ():
            if not key.name.startswith(".") and self.get_key(key.name) is None:
                key.unlink(missing_ok=True)

    def expired(self, ttl_s: float) -> list[str]:
        self._prune()
        cutoff = time.time() - ttl_s
        found = []
        for record in self.path.glob(f"*{SUFFIX}"):
            try:
                if record.stat().st_mtime < cutoff:
                    found.append(record.name[: -len(SUFFIX)])
            except FileNotFoundError:
                continue
        return found

    def count(self) -> int:
        if not self.path.is_dir():
            raise self._missing()
        return sum(1 for _ in self.path.glob(f"*{SUFFIX}"))

    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]:
        try:
            ids = os.listdir(self.owners / owner_key(owner))
        except FileNotFoundError:
            if not self.path.is_dir():
                raise self._missing() from None
            return []
        return page_of([i for i in ids if SESSION_ID.fullmatch(i)], after, limit, descending)

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

    def ping(self) -> None:
        """A real write: the only proof that the directory takes writes (permissions, read-only mounts, a
        full disk) whoever the server runs as."""
        self._ensure_layout()  # a directory made again is usable again
        probe = self.path / f".probe.{uuid.uuid4().hex}"
        with open(probe, "wb") as out:
            out.write(b"ok")
            os.fsync(out.fileno())
        probe.unlink()
