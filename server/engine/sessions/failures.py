"""How session commands fail: a busy session, a lookup gone stale, and a store failure as the answer its
caller gets (503 `store_unavailable`: nothing changed; 503 `outcome_unknown`: it may have)."""

from __future__ import annotations

from ..types import EngineError
from .stores import OutcomeUnknown
from .worker import error_kind


class SessionBusy(EngineError):
    """The session is generating, or its last change is being stored (409 once the caller's wait is over)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} is generating", kind="busy", param="session_id")


class StaleLookup(Exception):
    """The session changed between the store lookup and the engine thread: look it up again."""


def store_failure(error: BaseException, outcome: str) -> EngineError:
    """A store call that failed or ran out of time, as the 503 its caller gets."""
    if isinstance(error, EngineError):
        return error
    if isinstance(error, OutcomeUnknown):
        return EngineError("the session store took the change but did not answer in time: it may or may not have "
                           "been applied. Retrying with the same Idempotency-Key applies it at most once (and "
                           "returns the original result if it was); or read the session", kind="outcome_unknown")
    return EngineError(f"the session store is unavailable ({error_kind(error)}: {type(error).__name__}); {outcome}",
                       kind="store_unavailable")
