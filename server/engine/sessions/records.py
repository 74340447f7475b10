"""A session: a named, persistent state that is exactly consistent with its history.

Invariant: the state has consumed every history token except `pending` (the last sampled token, not
yet fed). When nothing is pending, `logits` holds the distribution for the next token, so a session can
continue with or without a new prompt. Nothing in a session grows with its length: besides the state it
keeps the token count, `seen` — a (vocab,) bool vector of every token in its history, which is all the
repetition penalty reads — and the last few tokens (`tail`, context for detokenizing what comes next).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # (only in annotations: the frontend reads this module's limits without torch)
    import torch

TAIL_TOKENS = 6  # history tokens kept as detokenizer context (as many as it re-decodes)
APPLIED_KEPT = 16  # idempotency keys a session remembers (the newest), each with the result it answered
APPLIED_TEXT_CHARS = 16_384  # a kept result's text, at most (longer: the key is kept, its result is not)
ENTRY_TEXT_CHARS = 2**20  # a stored response's text (and its request's input), at most, in its own entry
MAX_SESSION_TOKENS = 2**48  # ~2.8e14 tokens: more than any session can have consumed


@dataclass
class Session:
    id: str
    owner: str | None
    tokens: int = 0  # history length: consumed tokens plus the pending one
    pending: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (V,) fp32, when nothing is pending
    seen: torch.Tensor | None = None  # (V,) bool on the host: tokens in the history (None: empty history)
    tail: list[int] = field(default_factory=list)  # the last TAIL_TOKENS history tokens
    slot: int | None = None  # device tier
    host: dict[str, torch.Tensor] | None = None  # host tier (offloaded)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False
    turns: list[Turn] = field(default_factory=list)  # the last `session_turns_kept`, oldest first
    turn_count: int = 0  # turns completed (the index of the newest)
    revision: str | None = None  # the store record this copy matches (shared stores: freshness check)
    stored: bool = True  # False: created with a first prompt, not yet written (its first turn writes it)
    lease: str | None = None  # token of the shared store's per-session lease it holds (one writer across replicas)
    # the newest changes made with an Idempotency-Key: [{"key", "request", "turn", "result"}] (bounded, in the record)
    applied: list[dict] = field(default_factory=list)
    # each turn's text, newest last, at most `session_text_chars` in all (outside the fixed state bytes):
    # [{"turn", "tokens", "created", "prompt", "completion"}]
    texts: list[dict] = field(default_factory=list)
    entries_full: bool = False  # a stored response was not kept: its entries reached their budget (this process)

    def applied_entry(self, key: str) -> dict | None:
        return next((entry for entry in self.applied if entry["key"] == key), None)

    def remember(self, entry: dict) -> None:
        self.applied = [*(e for e in self.applied if e["key"] != entry["key"]), entry][-APPLIED_KEPT:]

    @property
    def tier(self) -> str:
        return "device" if self.slot is not None else "host"

    def nbytes(self) -> int:
        """Host bytes of everything the session holds: state (when offloaded), history, turn snapshots."""
        tensors = [*(self.host or {}).values(), self.logits, self.seen]
        for turn in self.turns:
            tensors += [*turn.state.values(), turn.history["logits"], turn.history["seen"]]
        words = len(self.pending) + len(self.tail) + sum(len(t.history["pending"]) + len(t.history["tail"])
                                                         for t in self.turns)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None) + 8 * words

    def copy_history(self) -> dict:
        """Everything but the state and the bookkeeping: what a fork or a turn snapshot copies."""
        return {"tokens": self.tokens, "pending": list(self.pending), "tail": list(self.tail),
                "logits": None if self.logits is None else self.logits.clone(),
                "seen": None if self.seen is None else self.seen.clone()}


class TurnMark(NamedTuple):
    """A kept turn as a listing shows it (no state: it crosses to the frontend process)."""

    index: int
    tokens: int
    created: float  # unix time


@dataclass(frozen=True)
class Turn:
    """The session as it was after one turn: its state (host copy) and history — one state's bytes plus
    the (vocab,) `seen` vector, whatever the history's length."""

    index: int
    tokens: int
    created: float  # unix time
    state: dict[str, torch.Tensor]
    history: dict


@dataclass(frozen=True)
class SessionInfo:
    id: str
    tokens: int
    state_bytes: int
    tier: str
    created: float
    last_used: float  # unix time
    revision: str | None = None  # changes with every change of the session (If-Match)


def new_session_id() -> str:
    """`sess-` + 12 hex digits of the creation time in milliseconds + 20 random hex digits: ids sort in
    creation order (a listing's order and cursor) and are still unguessable (80 random bits)."""
    return f"sess-{time.time_ns() // 1_000_000:012x}{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True)
class TurnResult:
    """What one request did to its session (built by the engine from the request; plain values)."""

    prompt_ids: list[int]
    consumed: int  # tokens of pending + prompt the state consumed
    last_logits: torch.Tensor | None  # (V,) after the last consumed token
    generated: int = 0
    counts: torch.Tensor | None = None  # (V,) generated-token counts, with `generated`
    next_token: int | None = None  # the last sampled token (pending from now on)
    recent: tuple[int, ...] = ()  # the last few generated tokens
    applied: dict | None = None  # made with an Idempotency-Key: {"key", "request", "result"} to remember
    text: tuple[str, str] | None = None  # (prompt, completion) as text, each at most the session's text budget
    next_logits: torch.Tensor | None = None  # (V,) the state consumed next_token too (a step failed after its
    # program committed): nothing is pending, these logits predict what follows


def keep_text(texts: list[dict], entry: dict, limit: int) -> list[dict]:
    """`texts` with `entry` added, the oldest dropped while they hold more than `limit` characters (a turn
    longer than that alone keeps its completion and the end of its prompt)."""
    if limit <= 0:
        return []
    kept = [*texts, entry]
    while len(kept) > 1 and sum(len(t["prompt"]) + len(t["completion"]) for t in kept) > limit:
        kept.pop(0)
    only = kept[0]
    if len(only["prompt"]) + len(only["completion"]) > limit:
        completion = only["completion"][-limit:]
        kept[0] = {**only, "completion": completion, "prompt": only["prompt"][len(only["prompt"]) - limit
                                                                            + len(completion):]}
    return kept
