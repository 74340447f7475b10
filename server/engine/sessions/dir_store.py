"""`dir:PATH` — the session store of one process: a file per session, its owner index and its entries in one
directory (see stores.py for what every store promises)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path

from .stores import (
    ENTRY_NAME,
    SESSION_ID,
    SUFFIX,
    BrokenRecord,
    StoreUnavailable,
    check_deadline,
    header_metadata,
    owner_key,
    page_of,
)

logger = logging.getLogger(__name__)


class DirStore:
    """`dir:PATH` — one `<id>.lsess` file per session (one process per directory)."""

    shared, keeps = False, True
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
        writing): record, entry, key and probe files never renamed into place, and owner indexes never finished."""
        for leftover in [*self.path.glob(".*"), *self.path.glob("entries/*/.*.tmp"), *self.path.glob("keys/.*.tmp")]:
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
        self._write_file(target, data, deadline)
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
        """Written aside, fsync'd, the deadline checked, then renamed over `target`: atomic, readers see the old
        file or the new one, never half (a temporary left by a killed process is swept at the next start)."""
        temporary = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(temporary, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            check_deadline(deadline, "write")
            os.replace(temporary, target)
        except BaseException:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
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
