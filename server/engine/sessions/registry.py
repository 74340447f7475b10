"""Session registry: tiers (device slot or host memory), LRU offload, TTL expiry, limits, fork, export,
import. Runs on the engine thread only, and never touches the store: a change that must be stored
returns a `StoreStep` (the write, run by the store worker, and how to settle it back here).

Durability: with a store, a create, continue, fork, import, rewind or delete is answered only after its
record is written (or removed). Until then the session is `busy` (nothing else can change it). A failed or
late write rolls the change back: a new session is dropped with its slot, a changed one drops its
in-memory copy (the store still holds its last acknowledged turn, which the next access loads), a failed
delete leaves the session as it was.

Capacity: once host memory is full, idle sessions pin at most `num_slots - reserved_slots` device slots,
so running requests (stateless ones above all) always get a slot eventually: the session limit is
`max_host_sessions + num_slots - reserved_slots` (the host count as many states as `host_sessions_mb` holds,
where that is fewer), and a session coming back from host memory may push the least recently used one out in
its place.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict

import torch

from linserve.model.interface import ServedModel

from ..accounting import check_token_ids
from ..state_pool import StatePool
from ..types import EngineError, Idempotency
from .failures import SessionBusy, StaleLookup, store_failure
from .leases import Lookup, StoreAccess
from .record_io import check_applied, record_write, session_from_record
from .records import (
    APPLIED_TEXT_CHARS,
    MAX_SESSION_TOKENS,
    TAIL_TOKENS,
    Session,
    SessionInfo,
    Turn,
    TurnResult,
    keep_text,
    new_session_id,
)
from .snapshot import model_fingerprint
from .stores import NoStore, OutcomeUnknown, SessionStore
from .tiers import Tiers
from .upkeep import Upkeep
from .worker import StoreStep, StoreWorker

logger = logging.getLogger(__name__)



class SessionRegistry:
    def __init__(self, pool: StatePool, model: ServedModel, max_host_sessions: int, ttl_s: float,
                 reserved_slots: int = 0, turns_kept: int = 8, store: SessionStore | None = None,
                 worker: StoreWorker | None = None, text_chars: int = 0, entries_bytes: int = 64 * 2**20) -> None:
        self.pool = pool
        self.entries_bytes = entries_bytes  # a session's stored responses in the store, at most
        self.text_chars = text_chars  # each session's turn text, at most (session_text_chars)
        self.store = store = store if store is not None else NoStore()  # (`none`: settled at once, see `through`)
        self.worker = worker  # the store's thread (None with NoStore: nothing to wait for)
        self.access = StoreAccess(store, self.held)
        if worker is not None:
            worker.after_probe.append(self.access.retry_releases)
        self.shared = store.shared  # replicas share it: leases and freshness checks
        self.stored = 0  # records in the store (counted by the sweep, on the store thread)
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.turns_kept = turns_kept
        self.max_host_sessions = max_host_sessions
        self.max_sessions = max_host_sessions + pool.num_slots - reserved_slots
        self.ttl_s = ttl_s
        self.by_id: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.tiers = Tiers(pool, self.by_id, max_host_sessions)
        self._fingerprint: str | None = None
        self.upkeep = Upkeep(self)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    def holds(self, session_id: str) -> bool:
        """Whether this process has the session in memory (any thread: a hint the engine thread re-checks)."""
        return session_id in self.by_id

    def held(self, session_id: str) -> tuple[bool, str | None]:
        """(held in memory, its revision) — read by the store thread as a hint."""
        session = self.by_id.get(session_id)
        return (False, None) if session is None else (True, session.revision)

    # ---- lookup ----
    def resolve(self, session_id: str, owner: str | None, found: Lookup | None) -> Session:
        """The session, from memory or from the record the store lookup fetched."""
        session = self.by_id.get(session_id)
        if found is not None:
            if session is not None and self.shared and not session.busy and session.revision != found.revision:
                self._drop(session)  # another replica advanced, rewound or deleted it since we held it
                session = None
            if session is None and found.data is not None:
                session = self._adopt(session_id, found.data)
            elif session is None and not found.fetched:
                raise StaleLookup(session_id)
        if session is None or session.owner != owner:  # another key's session does not exist for you
            raise EngineError(f"session {session_id!r} not found", kind="not_found", param="session_id")
        return session

    def claim(self, session: Session, found: Lookup | None) -> Session:
        """The session, idle, for a command that changes it (with the shared store's lease, if taken)."""
        if session.busy:
            raise SessionBusy(session.id)
        session.lease = found.lease if found is not None else None
        return session

    def _adopt(self, session_id: str, data: bytes) -> Session:
        """A session that is only in the store (after a restart, or expired from memory) comes back to the
        host tier, turns included; validated like an import, metadata too."""
        template = {name: buffer[0] for name, buffer in self.pool.buffers.items()}
        session = session_from_record(session_id, data, template, self.fingerprint, self.vocab_size)
        self.check_capacity()
        self.by_id[session_id] = session
        self.by_id.move_to_end(session_id, last=False)  # coldest: first to leave memory again
        return session

    def info(self, session: Session) -> SessionInfo:
        idle = time.monotonic() - session.last_used
        return SessionInfo(id=session.id, tokens=session.tokens, state_bytes=self.pool.slot_bytes, tier=session.tier,
                           created=session.created, last_used=time.time() - idle, revision=session.revision)

    def owned_infos(self, owner: str | None) -> dict[str, SessionInfo]:
        """The caller's sessions in memory, described (a listing's snapshot; engine thread)."""
        return {s.id: self.info(s) for s in self.by_id.values() if s.owner == owner}

    def touch(self, session: Session) -> None:
        session.last_used = time.monotonic()
        self.by_id.move_to_end(session.id)

    def check_capacity(self) -> None:
        if not self.pool.supports_sessions:
            raise EngineError("sessions need a linear-attention model (this one keeps a KV cache)", param="model")
        if len(self.by_id) >= self.max_sessions:
            raise EngineError(f"session limit reached ({self.max_sessions}): delete sessions or retry later",
                              kind="capacity")

    def check_store(self) -> None:
        """Refuse a change at once while the store is known to be down: it could not be acknowledged."""
        if self.worker is not None and not self.worker.up:
            raise EngineError(f"the session store is unavailable ({self.worker.last_error}); retry later",
                              kind="store_unavailable")

    # ---- writes ----
    def _record_write(self, session: Session, also=None):
        """The store write of the session as it is now (see `record_write`)."""
        return record_write(session, self.tiers.state_of(session), self.fingerprint, self.store, self.access, also)

    def through(self, step: StoreStep):
        """A change's store step: handed to the store worker (its answer waits for the write), or — with a store
        that keeps nothing (`none`) — run and settled at once, its answer returned as it stands."""
        return step if self.store.keeps else step.settle(None, step.run(None))

    def stored_change(self, session: Session, failed: str, new: bool = False, also=None) -> StoreStep | SessionInfo:
        """Answer once the session's record is written; if it is not, roll back (see the module doc). A new
        session whose write may have landed (outcome unknown) is deleted from the store again: its caller was
        told it failed and never learnt its id, so nothing may be left behind."""
        session.busy = True

        def settle(error: BaseException | None, _: object) -> SessionInfo:
            if error is not None:
                self.discard(session)
                if new:
                    self._undo_if_landed(session, error)
                raise store_failure(error, failed)
            session.busy, session.stored = False, True
            self.touch(session)
            return self.info(session)

        return self.through(StoreStep("put", self._record_write(session, also), settle))

    def _undo_if_landed(self, session: Session, error: BaseException) -> None:
        """A new session whose first write may have landed (outcome unknown) is deleted from the store again —
        retried until the store answers: its caller was told it failed and never learnt its id, so nothing
        may be left behind."""
        if isinstance(error, OutcomeUnknown):
            access, session_id, owner = self.access, session.id, session.owner or ""
            self.worker.submit("delete", lambda deadline: access.undo(session_id, owner), None)

    def add(self, session: Session) -> StoreStep | SessionInfo:
        self.by_id[session.id] = session
        return self.stored_change(session, "the session was not created", new=True)

    def discard(self, session: Session) -> None:
        """Drop the in-memory copy (and its slot), if it is still the one held."""
        if self.by_id.get(session.id) is session:
            self._drop(session)

    def _drop(self, session: Session) -> None:
        if session.slot is not None:
            self.tiers.unplace(session)
        del self.by_id[session.id]

    # ---- lifecycle ----
    def create(self, owner: str | None, first_prompt: bool = False,
               prompt_ids: list[int] | None = None) -> StoreStep | SessionInfo:
        """A new session. `first_prompt`: its record is written by its first turn (the prompt's prefill),
        not now — one write, so a create that fails half-way leaves no record behind. `prompt_ids`, when the
        caller has them already, are checked before the session exists."""
        if prompt_ids is not None:
            check_token_ids(prompt_ids, self.vocab_size)
        self.check_store()
        self.check_capacity()
        session = Session(id=new_session_id(), owner=owner)
        slot = self.tiers.allocate_slot()
        if slot is not None:
            self.tiers.place(session, slot)
        if first_prompt:
            session.stored = False
            self.by_id[session.id] = session
            return self.info(session)
        return self.add(session)

    def acquire_for_request(self, session: Session, new_tokens: int, idempotency: Idempotency | None = None,
                            expected_revision: str | None = None) -> Session:
        """A claimed session, busy from now until its turn is stored. A key it already applied answers with
        that turn's result (AlreadyApplied); a revision it has moved past is a 409 naming the current one."""
        check_applied(session, idempotency)
        if expected_revision is not None and expected_revision != session.revision:
            raise EngineError(f"the session is at revision {session.revision!r}, not {expected_revision!r} "
                              "(If-Match): it changed since you read it", kind="revision_mismatch", param="If-Match")
        if session.tokens + new_tokens > MAX_SESSION_TOKENS:  # so every record it writes can be imported back
            raise EngineError(f"the session would pass {MAX_SESSION_TOKENS} tokens", param="max_tokens")
        self.check_store()
        session.busy = True
        self.touch(session)
        return session

    def release(self, session: Session) -> None:
        """The end of a command that stored nothing (its lease, if any, is given back after queued writes)."""
        session.busy = False
        self.give_back_lease(session.id, session.lease)
        session.lease = None
        self.touch(session)

    def give_back_lease(self, session_id: str, lease: str | None) -> None:
        """Release a shared store's lease on the store thread, after every write queued before it."""
        if lease is not None:
            self.worker.submit("release", lambda deadline: self.access.release(session_id, lease), None)

    def commit(self, session: Session, turn: TurnResult) -> StoreStep | None:
        """After a request: the history grows by what the state consumed plus the sampled tokens; each
        change of the head is a turn. Returns the turn's store write (None: nothing to store; released)."""
        old_pending = len(session.pending)
        consumed_prompt: list[int] = []
        if turn.consumed >= old_pending and turn.consumed > 0:
            consumed_prompt = turn.prompt_ids[: turn.consumed - old_pending]
            session.pending, session.logits = [], turn.last_logits
        generated = turn.generated
        if not (consumed_prompt or generated):
            self.release(session)
            return None
        # out of place: these tensors may come from inside or outside inference mode
        seen = session.seen if session.seen is not None else torch.zeros(self.vocab_size, dtype=torch.bool)
        if consumed_prompt:
            seen = seen.index_fill(0, torch.tensor(consumed_prompt), True)
        if generated:
            seen = seen | (turn.counts > 0).cpu()
            session.pending, session.logits = (([turn.next_token], None) if turn.next_logits is None
                                               else ([], turn.next_logits))
        session.seen = seen
        session.tokens += len(consumed_prompt) + generated
        session.tail = (session.tail + consumed_prompt[-TAIL_TOKENS:] + list(turn.recent))[-TAIL_TOKENS:]
        self._record_turn(session)
        if turn.text is not None:
            session.texts = keep_text(session.texts, {
                "turn": session.turn_count, "tokens": session.tokens, "created": time.time(),
                "prompt": turn.text[0], "completion": turn.text[1]}, self.text_chars)
        also = self._remember(session, turn.applied) if turn.applied is not None else None
        new = not session.stored  # created with its first prompt: this turn's write creates its record

        def settle(error: BaseException | None, entry_kept: object) -> None:
            if error is not None:
                self.discard(session)  # the store keeps the last acknowledged turn; the next access loads it
                if new:
                    self._undo_if_landed(session, error)  # created with its first prompt: no record before
                raise store_failure(error, "this turn was not stored and is not part of the session")
            if entry_kept is False:
                session.entries_full = True
                logger.warning("session %s: its stored responses reached session_responses_mb (%d bytes); this "
                               "turn's response is not kept", session.id, self.entries_bytes)
            session.stored = True
            self.release(session)

        return self.through(StoreStep("put", self._record_write(session, also), settle))

    def _remember(self, session: Session, applied: dict):
        """Keep a keyed turn's result in the record (the newest APPLIED_KEPT); a stored response's also as its own
        store entry, for the session's life: returns that entry's write, run before the record's."""
        applied = {**applied, "turn": session.turn_count}
        if not applied.get("entry") or not self.store.keeps:
            session.remember(applied)
            return None
        data = json.dumps(applied).encode()
        small = len(data) <= APPLIED_TEXT_CHARS + 4096  # the record keeps small results; large ones only the entry
        session.remember(applied if small else {**applied, "result": None})
        store, session_id, name, budget = self.store, session.id, applied["key"], self.entries_bytes
        return lambda deadline: store.put_entry(session_id, name, data, budget, deadline)

    # ---- turns ----
    def _record_turn(self, session: Session) -> None:
        session.turn_count += 1
        if self.turns_kept == 0:
            return
        state = {name: t.clone() for name, t in self.tiers.state_of(session).items()}
        session.turns.append(Turn(index=session.turn_count, tokens=session.tokens, created=time.time(), state=state,
                                  history=session.copy_history()))
        del session.turns[: -self.turns_kept]

    def rewind(self, session: Session, index: int, idempotency: Idempotency | None = None) -> StoreStep | SessionInfo:
        """Make turn `index` the head again: its state and history back, later turns dropped."""
        try:
            check_applied(session, idempotency)
        except BaseException:
            self.release(session)
            raise
        turn = next((t for t in session.turns if t.index == index), None)
        if turn is None:
            kept = [t.index for t in session.turns]
            self.release(session)
            raise EngineError(f"turn {index} is not kept for this session (kept: {kept})", param="turn")
        for name, value in turn.history.items():
            setattr(session, name, value.clone() if isinstance(value, torch.Tensor) else
                    (list(value) if isinstance(value, list) else value))
        if session.slot is not None:
            self.pool.load(session.slot, turn.state)
        else:
            session.host = {name: t.clone() for name, t in turn.state.items()}
        session.turns = [t for t in session.turns if t.index <= index]
        session.texts = [t for t in session.texts if t["turn"] <= index]
        session.turn_count = index
        if idempotency is not None:
            session.remember({"key": idempotency.key, "request": idempotency.request, "turn": index,
                              "result": {"tokens": session.tokens}})
        self.touch(session)
        return self.stored_change(session, "the session was not rewound")

    def delete(self, session: Session) -> StoreStep | None:
        if not session.stored:  # (a session whose first turn never got stored)
            self._drop(session)
            self.give_back_lease(session.id, session.lease)
            session.lease = None
            return None
        session.busy = True
        store, access, lease = self.store, self.access, session.lease
        session_id, owner = session.id, session.owner or ""
        session.lease = None

        def remove(deadline: float | None) -> None:
            try:
                store.delete(session_id, owner, deadline)
            finally:
                if lease is not None:
                    access.release(session_id, lease)

        def settle(error: BaseException | None, _: object) -> None:
            session.busy = False
            if isinstance(error, OutcomeUnknown):
                self.discard(session)  # it may be gone: the store says, at the next access
            if error is not None:
                raise store_failure(error, "the session was not deleted")
            self.discard(session)

        return self.through(StoreStep("delete", remove, settle))

    def abandon(self, session_id: str, owner: str | None) -> None:
        """Engine thread: a failed create's session that could not be deleted through the store (down): the copy
        here is dropped and its record, if one landed, removed once the store answers (retried with the leases)."""
        session = self.by_id.get(session_id)
        if session is not None and session.owner == owner and not session.busy:
            self._drop(session)
        if self.worker is not None and self.store.keeps:
            access = self.access
            self.worker.submit("delete", lambda deadline: access.undo(session_id, owner or ""), None)

    def expire(self) -> None:
        """Housekeeping between steps (upkeep.py)."""
        self.upkeep.run()

    # ---- fork / export / import ----
