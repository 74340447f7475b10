"""How other threads reach the engine thread: commands (functions) queued with the future that gets their
result. The engine thread runs them between steps; once it is stopping, outside callers are refused; once
it has died, everything pending and everything later fails with kind `dead`; once it has left its loop,
the engine's own follow-ups (`internal`) run on the caller's thread, since nothing can race with them then.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from .types import EngineError

logger = logging.getLogger(__name__)

ENGINE_DEAD = "the engine has stopped after an internal error; the server is restarting"
IDLE_WAIT_S = 1.0  # an idle engine thread wakes this often for housekeeping

Command = tuple[Callable[[], object], "Future | None"]


def run_command(fn: Callable[[], object], future: Future | None) -> None:
    try:
        result = fn()
    except Exception as error:  # noqa: BLE001 - delivered to the caller (or logged: aborts have none)
        if future is None:
            logger.exception("engine command failed")
        else:
            future.set_exception(error)
        return
    if future is not None:
        future.set_result(result)


class CommandQueue:
    def __init__(self) -> None:
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()  # (C: one taker, the engine thread)
        self._lock = threading.Lock()  # orders enqueueing against stopping and death
        self.stopping = threading.Event()
        self.exited = False
        self.death: BaseException | None = None

    def call(self, fn: Callable[[], object]) -> Future:
        """`fn()` on the engine thread; the future gets its result or exception."""
        future: Future = Future()
        with self._lock:
            if self.death is not None:
                future.set_exception(EngineError(ENGINE_DEAD, kind="dead"))
            elif self.stopping.is_set():
                future.set_exception(EngineError("the engine is shutting down", kind="unavailable"))
            else:
                self._commands.put((fn, future))
        return future

    def internal(self, fn: Callable[[], object]) -> Future:
        """`call` for the engine's own follow-ups (a store write settling): taken while stopping too."""
        future: Future = Future()
        with self._lock:
            if self.death is None and not self.exited:
                self._commands.put((fn, future))
                return future
        run_command(fn, future)
        return future

    def post(self, fn: Callable[[], object]) -> None:
        """Fire and forget (aborts): dropped once the engine has died."""
        with self._lock:
            if self.death is None:
                self._commands.put((fn, None))

    def wake(self) -> None:
        self._commands.put((lambda: None, None))

    def drain(self, block: bool) -> bool:
        """Run queued commands (when `block`, wait up to IDLE_WAIT_S for the first). True if any ran. (Between
        every two steps: nothing queued is a look at the queue, no exception raised and caught.)"""
        commands = self._commands
        if block:
            try:
                command = commands.get(timeout=IDLE_WAIT_S)
            except queue.Empty:
                return False
        elif commands.empty():
            return False
        else:
            command = commands.get_nowait()  # (the engine thread alone takes: what it saw queued is there)
        while True:
            run_command(*command)
            if commands.empty():
                return True
            command = commands.get_nowait()

    def mark_exited(self) -> None:
        with self._lock:
            self.exited = True

    def die(self, error: BaseException) -> None:
        """Refuse everything from now on and fail every pending command."""
        with self._lock:
            self.death = error
            pending = []
            while not self._commands.empty():
                pending.append(self._commands.get_nowait())
        for _, future in pending:
            if future is not None:
                future.set_exception(EngineError(ENGINE_DEAD, kind="dead"))
