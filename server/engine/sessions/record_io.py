"""A session and its store record: what a change writes (run on the store thread), how a record comes back
(validated like an import), and the idempotency keys a session remembers (checked before a keyed change)."""

from __future__ import annotations

import json
import time
import uuid

from ..types import AlreadyApplied, EngineError, Idempotency
from .records import Session
from .snapshot import decode_snapshot, encode_snapshot, record_fields


def session_from_record(session_id: str, data: bytes, template: dict, fingerprint: str, vocab_size: int) -> Session:
    """The session a store record holds, turns included (400 naming the session if it is unreadable)."""
    try:
        snapshot = decode_snapshot(data, template, fingerprint, vocab_size, with_turns=True)
        fields = record_fields(snapshot.metadata)
    except EngineError as error:
        raise EngineError(f"session {session_id!r} is stored but unreadable: {error.message}",
                          param="session_id") from None
    return Session(id=session_id, host=snapshot.state, turns=list(snapshot.turns), **fields, **snapshot.history)


def check_applied(session: Session, idempotency: Idempotency | None) -> None:
    """A key this session already applied: its answer (AlreadyApplied); the key used for another request: 422."""
    entry = None if idempotency is None else session.applied_entry(idempotency.key)
    if entry is None:
        return
    if entry["request"] != idempotency.request:
        raise EngineError("this Idempotency-Key was used for another request on this session: a key names one "
                          "request", kind="idempotency_key_reused", param="Idempotency-Key")
    raise AlreadyApplied(session.id, entry.get("result"))


def record_write(session: Session, head_state: dict, fingerprint: str, store, access, also=None):
    """The store write of the session as it is now: immutable copies handed to the store thread, which
    encodes and writes them (and then releases the lease this change held). `also(deadline)`, if given, runs
    first (a stored response's entry): the write returns what it returns, and fails if it fails."""
    if not store.keeps:  # nothing is written (`none`): the change stands as it is, under a new revision
        session.revision = uuid.uuid4().hex
        return lambda deadline: also(deadline) if also is not None else None
    latest = session.turns[-1] if session.turns and session.turns[-1].index == session.turn_count else None
    # the newest turn's snapshot is the head's state (immutable): the store thread copies it, not this one
    state = latest.state if latest is not None else {n: t.clone() for n, t in head_state.items()}
    history, turns = session.copy_history(), tuple(session.turns)
    session.revision = uuid.uuid4().hex
    extra = {"owner": session.owner or "", "created": repr(session.created), "turn_count": str(session.turn_count),
             "revision": session.revision, "updated": repr(time.time())}
    if session.applied:
        extra["applied"] = json.dumps(session.applied)
    if session.texts:
        extra["texts"] = json.dumps(session.texts)
    session_id, revision, owner, lease = session.id, session.revision, session.owner or "", session.lease
    session.lease = None

    def write(deadline: float | None) -> object:
        own = {name: t.clone() for name, t in state.items()} if latest is not None else state
        try:
            before = also(deadline) if also is not None else None
            store.put(session_id, encode_snapshot(own, history, fingerprint, turns, extra), revision, owner,
                      deadline)
            return before
        finally:
            if lease is not None:
                access.release(session_id, lease)

    return write

