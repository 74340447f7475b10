"""Session changes that make or read a whole copy — fork (as it is, or at a kept turn), export, import — and
the changes a session remembers by key (a stored response: read, forgotten). Each takes the registry and runs
where it does, on the engine thread."""

from __future__ import annotations

import json

import torch

from ..types import EngineError
from .failures import SessionBusy, store_failure
from .records import Session, SessionInfo, new_session_id
from .registry import SessionRegistry
from .snapshot import decode_snapshot, encode_snapshot, turn_texts
from .worker import StoreStep


def fork(registry: SessionRegistry, source: Session, owner: str | None,
         at_turn: int | None = None) -> StoreStep | SessionInfo:
    """A new session with the source's state and history — as they are, or as they were after a kept turn."""
    if source.busy:  # mid-turn its state and history disagree
        raise SessionBusy(source.id)
    registry.check_store()
    if at_turn is not None and at_turn != source.turn_count:
        turn = next((t for t in source.turns if t.index == at_turn), None)
        if turn is None:
            kept = [t.index for t in source.turns]
            raise EngineError(f"turn {at_turn} of {source.id} is not kept (kept: {kept})", kind="turn_not_kept")
        registry.check_capacity()
        child = Session(id=new_session_id(), owner=owner, **{
            name: value.clone() if isinstance(value, torch.Tensor) else
            (list(value) if isinstance(value, list) else value) for name, value in turn.history.items()})
        child.host = {name: t.clone() for name, t in turn.state.items()}
        child.texts = inherited([text for text in source.texts if text["turn"] <= at_turn])
        registry.touch(source)
        return registry.add(child)
    registry.check_capacity()
    child = Session(id=new_session_id(), owner=owner, texts=inherited(source.texts), **source.copy_history())
    slot = registry.tiers.allocate_slot(keep=source) if source.slot is not None else None  # never offload the source
    if slot is not None:
        registry.pool.copy(source.slot, slot)  # a device copy of one fixed-size state
        registry.tiers.place(child, slot)
    else:
        child.host = {name: t.clone() for name, t in registry.tiers.state_of(source).items()}
    registry.touch(source)
    return registry.add(child)


def kept_result(registry: SessionRegistry, session: Session, key: str) -> dict | StoreStep:
    """A change this session remembers by key (a stored response): its entry, and where the session is now. The
    record keeps the newest; an older stored response is read from its own store entry."""
    entry = session.applied_entry(key)
    if entry is not None and entry.get("result") is not None:
        registry.touch(session)
        return _kept(session, entry)
    store, session_id = registry.store, session.id

    def settle(error: BaseException | None, data: bytes | None) -> dict:
        if error is not None:
            raise store_failure(error, "the response could not be read")
        if data is None:
            raise _not_kept(session)
        registry.touch(session)
        return _kept(session, json.loads(data))

    return registry.through(StoreStep("get", lambda deadline: store.get_entry(session_id, key), settle))


def _kept(session: Session, entry: dict) -> dict:
    return {"entry": entry, "turn_count": session.turn_count, "revision": session.revision,
            "tokens": session.tokens, "kept_turns": [t.index for t in session.turns]}


def _not_kept(session: Session) -> EngineError:
    full = " (this conversation's stored responses reached session_responses_mb: later ones were not kept)"
    return EngineError("not found" + (full if session.entries_full else ""), kind="not_found")


def forget(registry: SessionRegistry, session: Session, key: str) -> StoreStep | SessionInfo:
    """Drop a remembered change (a deleted response) from the record and its own entry, stored like any change
    of the session; one kept only in its entry is removed from there alone."""
    store, session_id = registry.store, session.id
    if session.applied_entry(key) is not None:
        session.applied = [entry for entry in session.applied if entry["key"] != key]
        return registry.stored_change(session, "it was not deleted",
                                      also=lambda deadline: store.delete_entry(session_id, key, deadline))
    session.busy = True

    def remove(deadline: float | None) -> bool:
        if store.get_entry(session_id, key) is None:
            return False
        store.delete_entry(session_id, key, deadline)
        return True

    def settle(error: BaseException | None, removed: bool | None) -> SessionInfo:
        registry.release(session)
        if error is not None:
            raise store_failure(error, "it was not deleted")
        if not removed:
            raise _not_kept(session)
        return registry.info(session)

    return registry.through(StoreStep("delete", remove, settle))


def export(registry: SessionRegistry, session: Session) -> bytes:
    if session.busy:
        raise SessionBusy(session.id)
    registry.touch(session)
    extra = {"texts": json.dumps(session.texts)} if session.texts else None
    return encode_snapshot(registry.tiers.state_of(session), session.copy_history(), registry.fingerprint,
                           extra=extra)


def inherited(texts: list[dict]) -> list[dict]:
    """Turn texts a fork or an import starts with: its history, before any turn of its own (turn 0)."""
    return [{**text, "turn": 0} for text in texts]


def import_(registry: SessionRegistry, data: bytes, owner: str | None) -> StoreStep | SessionInfo:
    registry.check_store()
    registry.check_capacity()
    template = {name: buffer[0] for name, buffer in registry.pool.buffers.items()}
    snapshot = decode_snapshot(data, template, registry.fingerprint, registry.model.config.vocab_size)
    session = Session(
        id=new_session_id(),
        owner=owner,
        pending=snapshot.pending,
        logits=snapshot.logits,
        host=snapshot.state,
        tokens=snapshot.tokens,
        seen=snapshot.seen,
        tail=snapshot.tail,
        texts=inherited(turn_texts(snapshot.metadata)),
    )
    return registry.add(session)
