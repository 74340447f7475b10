"""Where a session's state lives: a device slot (the state pool) or host memory. Slots are handed out
here, offloading the least recently used idle session to host memory when the pool is full and host
memory has room. Engine thread only; `by_id` is the registry's own (least recently used first).
"""

from __future__ import annotations

from collections import OrderedDict

from ..state_pool import StatePool
from .records import Session


class Tiers:
    def __init__(self, pool: StatePool, by_id: OrderedDict[str, Session], max_host_sessions: int) -> None:
        self.pool, self.by_id, self.max_host_sessions = pool, by_id, max_host_sessions
        # the sessions holding a slot — every session's slot is given by `place` and taken by `unplace`, and a
        # session leaves `by_id` only without one — so the counts reported after every step cost nothing, where
        # walking every session cost ~6 µs a hundred (the host tier holds 1,024 by default)
        self.on_device: dict[str, Session] = {}

    def counts(self) -> dict[str, int]:
        """Sessions per tier (reported after every engine step)."""
        device = len(self.on_device)
        return {"device": device, "host": len(self.by_id) - device}

    def place(self, session: Session, slot: int) -> None:
        """Give a session a device slot."""
        session.slot = slot
        self.on_device[session.id] = session

    def unplace(self, session: Session) -> None:
        """Free a session's slot (its state is wherever the caller put it)."""
        self.pool.free(session.slot)
        session.slot = None
        if self.on_device.get(session.id) is session:
            del self.on_device[session.id]

    def allocate_slot(self, keep: Session | None = None) -> int | None:
        """A free slot, offloading the least recently used idle session (never `keep`) to host memory if
        needed. `keep` on the host tier is about to leave it: its place there counts as free."""
        slot = self.pool.allocate()
        if slot is None:
            host_room = self.max_host_sessions - self.counts()["host"] + (keep is not None and keep.slot is None)
            if host_room > 0 and self._offload_lru(keep):
                slot = self.pool.allocate()
        return slot

    def _offload_lru(self, keep: Session | None) -> bool:
        for session in self.by_id.values():
            if session.slot is not None and not session.busy and session is not keep:
                self.offload(session)
                return True
        return False

    def offload(self, session: Session) -> None:
        """Device → host memory (its slot freed)."""
        session.host = self.pool.export(session.slot, "cpu")
        self.unplace(session)

    def bring_to_device(self, session: Session) -> int | None:
        if session.slot is not None:
            return session.slot
        slot = self.allocate_slot(keep=session)
        if slot is None:
            return None
        if session.host is not None:
            self.pool.load(slot, session.host)
            session.host = None
        self.place(session, slot)
        return slot

    def state_of(self, session: Session) -> dict:
        """The session's state as host tensors (zeros for a session that has consumed nothing)."""
        if session.slot is not None:
            return self.pool.export(session.slot, "cpu")
        if session.host is not None:
            return session.host
        return {name: buffer[0].new_zeros(buffer.shape[1:]).cpu() for name, buffer in self.pool.buffers.items()}
