"""`Idempotency-Key` and `If-Match` on the session calls that change something.

A session turn or rewind made with a key is remembered in the session's own record (the newest
APPLIED_KEPT keys, each with the result it answered), written by the same store write as the change: so a
retry after any failure — `outcome_unknown` included, on any replica, after any restart — finds out whether
the change landed, never applies it twice, and gets the first answer back (`Idempotent-Replayed: true`).
Calls that create or remove a session (create, fork, import, delete) keep what they answered under their key
(`KeyedResults`: in the session store for REMEMBERED_S — so on every replica and after a restart — and in
this process, which also covers a store that is down or `none`), and a delete whose outcome was unknown.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Annotated

from fastapi import Depends, Header, Request

from ...engine.types import Idempotency
from ..common.dependencies import Owner
from ..common.errors import APIError

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
REMEMBERED = 10_000  # keys of create / fork / import / delete kept in this process (the oldest forgotten first)
REMEMBERED_S = 24 * 3600.0
UNKNOWN = 0  # the status kept for a delete whose outcome was unknown
STORE_PREFIX = "idem-"  # a keyed result's name in the store

logger = logging.getLogger(__name__)


KEY_DOC = ("apply this change at most once: a retry with the same key (after a 503 `outcome_unknown`, a timeout "
           "or a lost connection) gets the first answer back, with `Idempotent-Replayed: true`")


async def idempotency_of(request: Request, owner: Owner, key: Annotated[str | None, Header(
        alias=HEADER, description=KEY_DOC, min_length=1, max_length=MAX_KEY_CHARS, pattern=r"^[!-~]+$")] = None
                         ) -> Idempotency | None:
    """The request's key (None: not sent): digests of the owner with the key, and of the request itself."""
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_KEY_CHARS or not all(33 <= ord(c) <= 126 for c in key):
        raise APIError(400, f"{HEADER} must be 1 to {MAX_KEY_CHARS} visible ASCII characters", HEADER,
                       code="invalid_idempotency_key")
    body = await request.body()
    request_digest = hashlib.sha256(f"{request.method} {request.url.path}\n".encode() + body).hexdigest()
    key_digest = hashlib.sha256(f"{owner or ''}\0{key}".encode()).hexdigest()
    return Idempotency(key=key_digest, request=request_digest, created=int(time.time()))


def expected_revision(value: Annotated[str | None, Header(
        alias="If-Match", description="the session's `revision`: continue only if nothing changed it since "
        "(else 409 `revision_mismatch` naming the current one)")] = None) -> str | None:
    """`If-Match: "<revision>"` (quotes and a weak prefix optional): change the session only at that revision."""
    if value is None:
        return None
    value = value.strip().removeprefix("W/").strip('"')
    if not value or value == "*":
        return None
    return value


IdempotencyDep = Annotated[Idempotency | None, Depends(idempotency_of)]
IfMatch = Annotated[str | None, Depends(expected_revision)]


class KeyedResults:
    """Answers of create / fork / import / delete by key digest: (request digest, status, JSON body or None). A
    delete whose outcome was unknown is kept as `UNKNOWN`: its retry finds the session gone (it landed) or there
    (it did not, and deletes it now). Kept in this process (bounded, oldest out first) and, with a store, in the
    store too: read here first, then there."""

    def __init__(self, limit: int = REMEMBERED, ttl_s: float = REMEMBERED_S) -> None:
        self.limit, self.ttl_s = limit, ttl_s
        self._entries: OrderedDict[str, tuple[float, str, int, object]] = OrderedDict()

    async def get(self, engine, key: Idempotency | None) -> tuple[int, object] | None:
        """(status, body) answered before for this key; None if none; 422 if the key named another request."""
        if key is None:
            return None
        entry = self._entries.get(key.key)
        if entry is not None and time.monotonic() - entry[0] > self.ttl_s:
            entry = None
        if entry is None:
            entry = await self._stored(engine, key.key)
        if entry is None:
            return None
        if entry[1] != key.request:
            raise APIError(422, f"this {HEADER} was used for another request: a key names one request", HEADER,
                           code="idempotency_key_reused")
        return entry[2], entry[3]

    async def _stored(self, engine, digest: str) -> tuple[float, str, int, object] | None:
        try:
            data = await asyncio.wrap_future(engine.sessions.keyed_result(STORE_PREFIX + digest))
        except Exception:  # noqa: BLE001 - the store is down: the change itself will say so (503)
            return None
        if data is None:
            return None
        kept = json.loads(data)
        return time.monotonic(), kept["request"], kept["status"], kept["body"]

    def forget(self, key: Idempotency) -> None:
        """This process's copy; the store's is overwritten by the key's next answer (or expires)."""
        self._entries.pop(key.key, None)

    async def put(self, engine, key: Idempotency | None, status: int, body: object) -> None:
        if key is None:
            return
        self._entries[key.key] = (time.monotonic(), key.request, status, body)
        self._entries.move_to_end(key.key)
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)
        data = json.dumps({"request": key.request, "status": status, "body": body}).encode()
        try:
            await asyncio.wrap_future(engine.sessions.keep_keyed_result(STORE_PREFIX + key.key, data, self.ttl_s))
        except Exception:  # noqa: BLE001 - kept here still: a retry reaching this replica is answered
            logger.warning("the answer to an %s could not be stored (kept in this process only)", HEADER,
                           exc_info=True)
