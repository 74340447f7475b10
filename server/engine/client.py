"""What the HTTP side holds of an engine: the in-process `Engine` (core.py) or, with the engine core in a process of
its own, a `RemoteEngine` (engine_process/remote.py) carrying each call over the channel. Both have this surface;
the API is typed against it, so a frontend process imports neither the engine nor torch (its RSS is the web
stack's and the tokenizer's, ~200 MB less than with torch loaded)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from .grammar import GrammarCompiler
from .types import EngineFacts, EngineRequest, RequestOutput


class EngineClient(Protocol):
    facts: EngineFacts  # what the engine serves: vocabulary, slots, device, dtype, the decode step's kind
    sessions: object  # session commands (create, info, fork, export, import_, turns, rewind, …): each a Future
    on_death: list[Callable[[BaseException], None]]  # run once if the engine dies (/health and /ready turn 503)

    @property
    def alive(self) -> bool: ...

    @property
    def grammars(self) -> GrammarCompiler: ...  # (the engine's: a GrammarRuntime, the compiler and the masks)

    def submit(self, request: EngineRequest, sink: Callable[[RequestOutput], None]) -> Future: ...

    def abort(self, request_id: str) -> None: ...

    def describe_decode_step(self) -> dict | None: ...

    def describe_speculation(self) -> dict | None: ...

    def store_status(self) -> dict | None: ...

    def stop(self, timeout: float = ...) -> None: ...
