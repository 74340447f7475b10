"""The session API's request and response models (router.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..common.protocol import Int, Text


class SessionCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: Text | list[Int] = ""


class SessionCreated(BaseModel):
    id: str
    tokens: int
    state_bytes: int
    revision: str | None = Field(None, description="changes with every change of the session: send it as "
                                 "`If-Match` to continue only if nothing changed it since")


class SessionDetail(SessionCreated):
    tier: str
    created: float
    last_used: float


class SessionList(BaseModel):
    """A page of the caller's sessions, newest first unless `order=asc`; the next page: `after=<last_id>`."""

    object: Literal["list"] = "list"
    data: list[SessionDetail]
    first_id: str | None
    last_id: str | None
    has_more: bool


class SessionRef(BaseModel):
    id: str


class RewindRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    turn: Int = Field(ge=1, description="a kept turn's index (GET /v1/sessions/{id}/turns)")


class TurnInfo(BaseModel):
    turn: int  # 0: text a fork or an import brought with it (before the session's own turns)
    tokens: int  # the session's length after this turn
    created: float  # unix time
    rewindable: bool = Field(True, description="its state snapshot is kept (the newest session_turns_kept turns)")
    prompt: str | None = Field(None, description="the turn's prompt as text, while the session keeps it "
                               "(session_text_chars, newest turns first)")
    completion: str | None = Field(None, description="the turn's generated text, while kept")
