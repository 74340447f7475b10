"""Session registry: tiers (device slot or host memory), LRU offload, TTL expiry, limits, fork, export,
import. Runs on the engine thread only.

Capacity: once host memory is full, idle sessions pin at most `num_slots - reserved_slots` device slots,
so running requests (stateless ones above all) always get a slot eventually: the session limit is
`max_host_sessions + num_slots - reserved_slots`, and a session coming back from host memory may push
the least recently used one out in its place.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

import torch

from model import LinearGPT

from .sessions import TAIL_TOKENS, Session, SessionInfo, Turn, decode_snapshot, encode_snapshot, model_fingerprint, new_session_id
from .session_leases import SharedStoreAccess
from .session_store import SessionStore, StoreWriter
from .state_pool import StatePool
from .types import EngineError

if TYPE_CHECKING:
    from .live import LiveRequest

EXPIRY_CHECK_INTERVAL_S = 1.0
STORE_SWEEP_INTERVAL_S = 10.0

logger = logging.getLogger(__name__)
class SessionManager(SharedStoreAccess):
    def __init__(self, pool: StatePool, model: LinearGPT, max_host_sessions: int, ttl_s: float,
                 reserved_slots: int = 0, turns_kept: int = 8, store: SessionStore | None = None,
                 writer: StoreWriter | None = None) -> None:
        self.pool = pool
        self.store, self.writer = store, writer
        self.stored = store.count() if store is not None else 0  # records in the store (refreshed by the sweep)
        self._deleting: set[str] = set()  # deleted, record not yet removed by the writer: never load these
        self.shared = store is not None and store.shared  # replicas share it: leases and freshness checks
        self.replica = uuid.uuid4().hex  # this process's name, the first half of every lease token it takes
        self._unwritten: Counter[str] = Counter()  # queued writes per session (our copy is newer than the store)
        self._unwritten_lock = threading.Lock()
        self._last_renew = 0.0
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.turns_kept = turns_kept
        self.max_host_sessions = max_host_sessions
        self.max_sessions = max_host_sessions + pool.num_slots - reserved_slots
        self.ttl_s = ttl_s
        self.sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._fingerprint: str | None = None
        self._last_expiry = 0.0
        self._last_store_sweep = 0.0

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    # ---- lookup ----
    def get(self, session_id: str, owner: str | None) -> Session:
        session = self.sessions.get(session_id)
        if session is not None and self.shared and not session.busy:
            session = self._fresh(session)
        if session is None and self.store is not None and session_id not in self._deleting:
            session = self._load(session_id)
        if session is None or session.owner != owner:  # another key's session does not exist for you
            raise EngineError(f"session {session_id!r} not found", kind="not_found", param="session_id")
        return session

    def _load(self, session_id: str) -> Session | None:
        """A session that is only in the store (after a restart, or expired from memory) comes back to the
        host tier, turns included; validated like an import."""
        data = self.store_call(self.store.get, session_id)
        if data is None:
            return None
        template = {name: buffer[0] for name, buffer in self.pool.buffers.items()}
        try:
            snapshot = decode_snapshot(data, template, self.fingerprint, self.vocab_size, with_turns=True)
        except EngineError as error:
            raise EngineError(f"session {session_id!r} is stored but unreadable: {error.message}",
                              param="session_id") from None
        self._check_capacity()
        meta = snapshot.metadata
        session = Session(id=session_id, owner=meta.get("owner") or None, host=snapshot.state,
                          created=float(meta.get("created", time.time())), turns=list(snapshot.turns),
                          turn_count=int(meta.get("turn_count", 0)), revision=meta.get("revision"),
                          **snapshot.history)
        self.sessions[session_id] = session
        self.sessions.move_to_end(session_id, last=False)  # coldest: first to leave memory again
        return session

    def _persist(self, session: Session) -> None:
        """Hand the writer thread immutable copies of the session; it encodes and writes them. A lease
        held for this change is released once the record is written."""
        if self.writer is None:
            return
        latest = session.turns[-1] if session.turns and session.turns[-1].index == session.turn_count else None
        # the newest turn's snapshot is the head's state (immutable): the writer copies it, not this thread
        state = latest.state if latest is not None else {n: t.clone() for n, t in self._state_of(session).items()}
        history, turns = session.copy_history(), tuple(session.turns)
        session.revision = uuid.uuid4().hex
        extra = {"owner": session.owner or "", "created": repr(session.created), "turn_count": str(session.turn_count),
                 "revision": session.revision, "updated": repr(time.time())}
        fingerprint = self.fingerprint
        session_id, release = session.id, self._take_lease(session)

        def encode() -> bytes:
            own = {name: t.clone() for name, t in state.items()} if latest is not None else state
            return encode_snapshot(own, history, fingerprint, turns, extra)

        def landed() -> None:  # written or failed: from now on the store's revision decides what is newest
            with self._unwritten_lock:
                self._unwritten[session_id] -= 1
                if self._unwritten[session_id] <= 0:
                    del self._unwritten[session_id]

        with self._unwritten_lock:
            self._unwritten[session_id] += 1
        self.writer.put(session_id, encode, session.revision, session.owner or "", done=release, after=landed)

    def info(self, session: Session) -> SessionInfo:
        idle = time.monotonic() - session.last_used
        return SessionInfo(id=session.id, tokens=session.tokens, state_bytes=self.pool.slot_bytes, tier=session.tier,
                           created=session.created, last_used=time.time() - idle)

    def owned_infos(self, owner: str | None) -> dict[str, SessionInfo]:
        """The caller's sessions in memory, described (a listing's snapshot; engine thread)."""
        return {s.id: self.info(s) for s in self.sessions.values() if s.owner == owner}

    def count(self, tier: str) -> int:
        return self.tier_counts()[tier]

    def tier_counts(self) -> dict[str, int]:
        """Sessions per tier, in one pass (reported after every engine step)."""
        counts = {"device": 0, "host": 0}
        for session in self.sessions.values():
            counts[session.tier] += 1
        return counts

    def _touch(self, session: Session) -> None:
        session.last_used = time.monotonic()
        self.sessions.move_to_end(session.id)

    def _check_capacity(self) -> None:
        if not self.pool.supports_sessions:
            raise EngineError("sessions need a linear-attention model (this one keeps a KV cache)", param="model")
        if len(self.sessions) >= self.max_sessions:
            raise EngineError(f"session limit reached ({self.max_sessions}): delete sessions or retry later",
                              kind="capacity")

    def _add(self, session: Session) -> SessionInfo:
        self.sessions[session.id] = session
        self._persist(session)
        return self.info(session)

    def _idle(self, session_id: str, owner: str | None) -> Session:
        session = self.get(session_id, owner)
        if session.busy:
            raise EngineError(f"session {session_id!r} is generating", kind="busy", param="session_id")
        return session

    # ---- lifecycle ----
    def create(self, owner: str | None) -> SessionInfo:
        self._check_capacity()
        return self._add(Session(id=new_session_id(), owner=owner, slot=self.allocate_slot()))

    def acquire_for_request(self, session_id: str, owner: str | None) -> Session:
        session = self._claim(session_id, owner)
        session.busy = True
        self._touch(session)
        return session

    def release(self, session: Session) -> None:
        session.busy = False
        self._release_lease(session)  # no-op after a commit that handed it to its write
        self._touch(session)

    def commit(self, session: Session, live: LiveRequest) -> None:
        """After a request: the history grows by what the state consumed plus the sampled tokens; each
        change of the head is a turn."""
        old_pending = len(session.pending)
        consumed_prompt: list[int] = []
        if live.consumed >= old_pending and live.consumed > 0:
            consumed_prompt = live.request.prompt_ids[: live.consumed - old_pending]
            session.pending, session.logits = [], live.last_logits
        row = live.rows[0] if live.rows else None
        generated = row.num_generated if row is not None else 0
        if consumed_prompt or generated:
            # out of place: these tensors may come from inside or outside inference mode
            seen = session.seen if session.seen is not None else torch.zeros(self.vocab_size, dtype=torch.bool)
            if consumed_prompt:
                seen = seen.index_fill(0, torch.tensor(consumed_prompt), True)
            if generated:
                seen = seen | (row.counts > 0).cpu()
                session.pending, session.logits = [row.next_token], None
            session.seen = seen
            session.tokens += len(consumed_prompt) + generated
            recent = list(row.recent) if row is not None and row.recent is not None else []
            session.tail = (session.tail + consumed_prompt[-TAIL_TOKENS:] + recent)[-TAIL_TOKENS:]
            self._record_turn(session)
            self._persist(session)
        self.release(session)

    # ---- turns ----
    def _record_turn(self, session: Session) -> None:
        session.turn_count += 1
        if self.turns_kept == 0:
            return
        state = {name: t.clone() for name, t in self._state_of(session).items()}
        session.turns.append(Turn(index=session.turn_count, tokens=session.tokens, created=time.time(), state=state,
                                  history=session.copy_history()))
        del session.turns[: -self.turns_kept]

    def turns(self, session_id: str, owner: str | None) -> list[Turn]:
        return list(self.get(session_id, owner).turns)

    def rewind(self, session_id: str, owner: str | None, index: int) -> SessionInfo:
        """Make turn `index` the head again: its state and history back, later turns dropped."""
        session = self._claim(session_id, owner)
        turn = next((t for t in session.turns if t.index == index), None)
        if turn is None:
            kept = [t.index for t in session.turns]
            self._release_lease(session)
            raise EngineError(f"turn {index} is not kept for this session (kept: {kept})", param="turn")
        for name, value in turn.history.items():
            setattr(session, name, value.clone() if isinstance(value, torch.Tensor) else
                    (list(value) if isinstance(value, list) else value))
        if session.slot is not None:
            self.pool.load(session.slot, turn.state)
        else:
            session.host = {name: t.clone() for name, t in turn.state.items()}
        session.turns = [t for t in session.turns if t.index <= index]
        session.turn_count = index
        self._touch(session)
        self._persist(session)
        return self.info(session)

    def delete(self, session_id: str, owner: str | None) -> None:
        session = self._claim(session_id, owner)
        self._drop(session)
        if self.writer is not None:
            self._deleting.add(session_id)
            self.writer.delete(session_id, lambda: self._deleting.discard(session_id), session.owner or "")
            self._release_lease(session)

    def _drop(self, session: Session) -> None:
        if session.slot is not None:
            self.pool.free(session.slot)
        del self.sessions[session.id]

    def expire(self) -> None:
        self.renew_leases()
        now = time.monotonic()
        if now - self._last_expiry < EXPIRY_CHECK_INTERVAL_S:
            return
        self._last_expiry = now
        for session in [s for s in self.sessions.values() if not s.busy and now - s.last_used > self.ttl_s]:
            self._drop(session)  # with a store, its record stays until the store's own expiry below
        if self.store is not None and now - self._last_store_sweep >= STORE_SWEEP_INTERVAL_S:
            self._last_store_sweep = now
            try:
                for session_id in self.store.expired(self.ttl_s):
                    if session_id not in self.sessions:
                        self.writer.delete(session_id)
                self.stored = self.store.count()
            except Exception:  # noqa: BLE001 - a store that cannot be listed is retried next sweep
                logger.exception("session store sweep failed")

    # ---- tiers ----
    def allocate_slot(self, keep: Session | None = None) -> int | None:
        """A free slot, offloading the least recently used idle session (never `keep`) to host memory if
        needed. `keep` on the host tier is about to leave it: its place there counts as free."""
        slot = self.pool.allocate()
        if slot is None:
            host_room = self.max_host_sessions - self.count("host") + (keep is not None and keep.slot is None)
            if host_room > 0 and self._offload_lru(keep):
                slot = self.pool.allocate()
        return slot

    def _offload_lru(self, keep: Session | None) -> bool:
        for session in self.sessions.values():
            if session.slot is not None and not session.busy and session is not keep:
                self.offload(session)
                return True
        return False

    def offload(self, session: Session) -> None:
        """Device → host memory (its slot freed)."""
        session.host = self.pool.export(session.slot, "cpu")
        self.pool.free(session.slot)
        session.slot = None

    def forget(self, session_id: str) -> None:
        """Drop an idle session from memory only (its store record stays): as after a restart."""
        session = self.sessions[session_id]
        if self.store is None or session.busy:
            raise EngineError("only an idle session with a store record can be forgotten", param="session_id")
        self._drop(session)

    def bring_to_device(self, session: Session) -> int | None:
        if session.slot is not None:
            return session.slot
        slot = self.allocate_slot(keep=session)
        if slot is None:
            return None
        if session.host is not None:
            self.pool.load(slot, session.host)
            session.host = None
        session.slot = slot
        return slot

    # ---- fork / export / import ----
    def _state_of(self, session: Session) -> dict:
        if session.slot is not None:
            return self.pool.export(session.slot, "cpu")
        if session.host is not None:
            return session.host
        return {name: buffer[0].new_zeros(buffer.shape[1:]).cpu() for name, buffer in self.pool.buffers.items()}

    def fork(self, session_id: str, owner: str | None) -> SessionInfo:
        source = self._idle(session_id, owner)
        self._check_capacity()
        child = Session(id=new_session_id(), owner=owner, **source.copy_history())
        slot = self.allocate_slot(keep=source) if source.slot is not None else None  # never offload the source
        if slot is not None:
            self.pool.copy(source.slot, slot)  # a device copy of one fixed-size state
            child.slot = slot
        else:
            child.host = {name: t.clone() for name, t in self._state_of(source).items()}
        self._touch(source)
        return self._add(child)

    def export(self, session_id: str, owner: str | None) -> bytes:
        session = self._idle(session_id, owner)
        self._touch(session)
        return encode_snapshot(self._state_of(session), session.copy_history(), self.fingerprint)

    def import_(self, data: bytes, owner: str | None) -> SessionInfo:
        self._check_capacity()
        template = {name: buffer[0] for name, buffer in self.pool.buffers.items()}
        snapshot = decode_snapshot(data, template, self.fingerprint, self.model.config.vocab_size)
        session = Session(id=new_session_id(), owner=owner, pending=snapshot.pending, logits=snapshot.logits,
                          host=snapshot.state, tokens=snapshot.tokens, seen=snapshot.seen, tail=snapshot.tail)
        return self._add(session)
