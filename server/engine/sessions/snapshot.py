"""A session's snapshot: its state and history (and, in a store record, its kept turns and bookkeeping) as
safetensors bytes with a format version and the model's fingerprint; resuming from one is
indistinguishable from never having left, penalties included. Decoding validates everything.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from linserve.model.interface import ServedModel
from linserve.model.weights import content_digest

from ..types import EngineError
from .records import MAX_SESSION_TOKENS, TAIL_TOKENS, Turn

SNAPSHOT_FORMAT = "linserve-session"
SNAPSHOT_VERSION = "2"  # 1 had no `seen`/`tail`: still imported, with an empty penalty history
# What a real state can hold. A trained model's S, z and convolution window stay many orders of magnitude
# below this (the shipped model, 16,384 random tokens: max |S| 943, max z 817); a state above it cannot
# have come from the model and overflows fp32 in φ(q)ᵀS. z = Σ φ(k) is never negative (φ is positive).
MAX_STATE_MAGNITUDE = 1e12


def model_fingerprint(model: ServedModel) -> str:
    """sha256 over the config and every weight: a snapshot only resumes on the model that made it."""
    return content_digest(model).hexdigest()


def _snapshot_tensors(state: dict[str, torch.Tensor], history: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    tensors = {f"{prefix}state.{name}": t.detach().cpu().contiguous() for name, t in state.items()}
    tensors[f"{prefix}pending"] = torch.tensor(history["pending"], dtype=torch.int64)
    tensors[f"{prefix}tail"] = torch.tensor(history["tail"], dtype=torch.int64)
    if history["logits"] is not None:
        tensors[f"{prefix}logits"] = history["logits"].detach().float().cpu().contiguous()
    if history["seen"] is not None:
        tensors[f"{prefix}seen"] = history["seen"].detach().cpu().contiguous()
    return tensors


def encode_snapshot(state: dict[str, torch.Tensor], history: dict, fingerprint: str, turns: tuple = (),
                    extra: dict[str, str] | None = None) -> bytes:
    """The head (state + history, see Session.copy_history) and, for the session store, kept turns and
    extra metadata (owner, created)."""
    tensors = _snapshot_tensors(state, history)
    for turn in turns:
        tensors.update(_snapshot_tensors(turn.state, turn.history, f"turn.{turn.index}."))
    metadata = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "fingerprint": fingerprint,
                "tokens": str(history["tokens"]), **(extra or {})}
    if turns:
        metadata["turns"] = json.dumps([{"index": t.index, "tokens": t.tokens, "created": t.created} for t in turns])
    return st_save(tensors, metadata=metadata)


@dataclass(frozen=True)
class Snapshot:
    state: dict[str, torch.Tensor]
    pending: list[int]
    logits: torch.Tensor | None
    tokens: int
    seen: torch.Tensor | None
    tail: list[int]
    metadata: dict[str, str] = field(default_factory=dict)
    turns: tuple[Turn, ...] = ()

    @property
    def history(self) -> dict:
        return {"tokens": self.tokens, "pending": self.pending, "logits": self.logits, "seen": self.seen,
                "tail": self.tail}


def record_fields(metadata: dict[str, str]) -> dict:
    """The bookkeeping a store record carries beside the snapshot (owner, creation time, turn count,
    revision), validated: a record with a malformed field is unreadable, never a server error."""
    try:
        created = float(metadata.get("created", "0"))
        turn_count = int(metadata.get("turn_count", "0"))
    except ValueError:
        raise _invalid("its created time or turn count is not a number") from None
    if not (math.isfinite(created) and 0 <= created < 2**40 and 0 <= turn_count <= MAX_SESSION_TOKENS):
        raise _invalid("its created time or turn count is out of range")
    try:
        applied = json.loads(metadata.get("applied", "[]"))
    except ValueError:
        raise _invalid("its idempotency keys are not JSON") from None
    if not (isinstance(applied, list) and all(isinstance(e, dict) and isinstance(e.get("key"), str)
                                              and isinstance(e.get("request"), str) for e in applied)):
        raise _invalid("its idempotency keys are malformed")
    return {"owner": metadata.get("owner") or None, "created": created, "turn_count": turn_count,
            "revision": metadata.get("revision"), "applied": applied, "texts": turn_texts(metadata)}


def turn_texts(metadata: dict[str, str]) -> list[dict]:
    """The turns' text a record or an exported snapshot carries, validated (malformed: unreadable)."""
    try:
        texts = json.loads(metadata.get("texts", "[]"))
    except ValueError:
        raise _invalid("its turn texts are not JSON") from None
    fields = {"turn": int, "tokens": int, "created": float, "prompt": str, "completion": str}
    if not (isinstance(texts, list) and all(
            isinstance(t, dict) and set(t) == set(fields) and all(
                isinstance(t[name], kind) or (kind is float and isinstance(t[name], int))
                for name, kind in fields.items()) for t in texts)):
        raise _invalid("its turn texts are malformed")
    return texts


def _invalid(message: str) -> EngineError:
    return EngineError(f"invalid session snapshot: {message}", kind="invalid", param="snapshot")


def decode_snapshot(data: bytes, template: dict[str, torch.Tensor], fingerprint: str, vocab_size: int,
                    with_turns: bool = False) -> Snapshot:
    """Parse and validate; every problem is an EngineError saying what is wrong. Kept turns (a session
    store's record) are read only `with_turns`; an exported snapshot has none."""
    try:
        tensors = st_load(data)
        metadata = _read_metadata(data)
    except Exception as error:  # noqa: BLE001 - any parse failure is the client's bad input
        raise _invalid(f"not a safetensors file ({error.__class__.__name__})") from None
    if metadata.get("format") != SNAPSHOT_FORMAT:
        raise _invalid(f"format is {metadata.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
    version = metadata.get("version")
    if version not in ("1", SNAPSHOT_VERSION):
        raise _invalid(f"version {version!r} is not supported (expected {SNAPSHOT_VERSION})")
    if metadata.get("fingerprint") != fingerprint:
        raise _invalid("it was made by a different model (fingerprint mismatch)")
    head = {name: t for name, t in tensors.items() if not (with_turns and name.startswith("turn."))}
    snapshot = _validated(head, metadata.get("tokens", ""), version, template, vocab_size)
    turns = []
    if with_turns:
        try:
            listed = json.loads(metadata.get("turns", "[]"))
            indices = [(int(t["index"]), int(t["tokens"]), float(t["created"])) for t in listed]
        except (ValueError, TypeError, KeyError):
            raise _invalid("the turn list is malformed") from None
        for index, tokens, created in indices:
            prefix = f"turn.{index}."
            group = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
            turn = _validated(group, str(tokens), version, template, vocab_size)
            turns.append(Turn(index=index, tokens=tokens, created=created, state=turn.state, history=turn.history))
    return Snapshot(**{**snapshot.__dict__, "metadata": metadata, "turns": tuple(turns)})


def _validated(tensors: dict[str, torch.Tensor], tokens_text: str, version: str, template: dict[str, torch.Tensor],
               vocab_size: int) -> Snapshot:
    invalid = _invalid
    expected = {f"state.{name}" for name in template} | {"pending"}
    names = set(tensors)
    optional = {"logits", "seen"} | ({"tail"} if version == "1" else set())
    if version != "1":
        expected |= {"tail"}
    if not expected <= names or names - expected - optional:
        raise invalid(f"tensors {sorted(names)} do not match the model's state {sorted(expected)}")
    state = {}
    for name, like in template.items():
        got = tensors[f"state.{name}"]
        if got.shape != like.shape or got.dtype != like.dtype:
            raise invalid(f"{name} is {tuple(got.shape)} {got.dtype}, expected {tuple(like.shape)} {like.dtype}")
        if not torch.isfinite(got).all():
            raise invalid(f"{name} holds non-finite values")
        if got.abs().max() > MAX_STATE_MAGNITUDE:
            raise invalid(f"{name} holds values beyond {MAX_STATE_MAGNITUDE:g}, which no real state reaches")
        if name.endswith(".z") and (got < 0).any():
            raise invalid(f"{name} holds negative values (z is a sum of positive features)")
        state[name] = got
    pending = tensors["pending"]
    if pending.dtype != torch.int64 or pending.ndim != 1 or len(pending) > 1:
        raise invalid("pending must be an int64 vector of at most one token")
    if len(pending) and not 0 <= int(pending[0]) < vocab_size:
        raise invalid("pending token is outside the vocabulary")
    logits = tensors.get("logits")
    if logits is not None and (logits.shape != (vocab_size,) or logits.dtype != torch.float32
                               or not torch.isfinite(logits).all() or logits.abs().max() > MAX_STATE_MAGNITUDE):
        raise invalid(f"logits must be finite float32 of shape ({vocab_size},) within ±{MAX_STATE_MAGNITUDE:g}")
    seen = tensors.get("seen")
    if seen is not None and (seen.shape != (vocab_size,) or seen.dtype != torch.bool):
        raise invalid(f"seen must be a bool vector of shape ({vocab_size},)")
    tail = tensors.get("tail", torch.zeros(0, dtype=torch.int64))
    if tail.dtype != torch.int64 or tail.ndim != 1 or len(tail) > TAIL_TOKENS:
        raise invalid(f"tail must be an int64 vector of at most {TAIL_TOKENS} tokens")
    if len(tail) and not bool(((tail >= 0) & (tail < vocab_size)).all()):
        raise invalid("tail holds tokens outside the vocabulary")
    try:
        tokens = int(tokens_text)
    except ValueError:
        raise invalid("tokens is not an integer") from None
    if not 0 <= tokens <= MAX_SESSION_TOKENS:
        raise invalid(f"tokens must be in [0, {MAX_SESSION_TOKENS}]")
    if tokens < len(pending) or (tokens > 0 and not len(pending) and logits is None):
        raise invalid("token count, pending token and logits are inconsistent")
    return Snapshot(state=state, pending=pending.tolist(), logits=logits, tokens=tokens, seen=seen,
                    tail=tail.tolist())


def _read_metadata(data: bytes) -> dict[str, str]:
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return header.get("__metadata__", {}) or {}
