"""The engine core process: loads the model and runs the engine (server/engine/core.py) as `serve` would in
one process, and serves one frontend over its connection (channel.py) until told to stop or the frontend is
gone — then it drains as the in-process server does (running requests end with `abort`, every session turn
handed to the store is written) and exits.

Its main thread reads the frontend's messages and hands them to the engine (whose own queue orders them);
what the engine produces — outputs, stats, answers — is collected in an `Outbox` and sent as one message
when the engine thread reports its pool after a step or a batch of commands.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection

from ..engine.command_queue import ENGINE_DEAD
from ..engine.cpu_threads import in_passing_thread
from ..engine.types import PoolStats
from .channel import ANSWERED_AT_ONCE, CALLS, crossing

logger = logging.getLogger("linserve.server.engine_process")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # (serve.py's)


class Outbox:
    """Events for the frontend, sent together: appended from any thread (a deque: no lock), sent as one
    `("batch", events)` by `flush` — which the engine thread calls once per step, after its PoolStats. Every
    write to the connection holds `send_lock` (the engine thread, the store's thread and the main thread all
    send)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.events: collections.deque = collections.deque()
        self.send_lock = threading.RLock()
        self.open = False  # held until "ready" is sent: nothing may overtake it
        self.broken = False
        self._last_pool: PoolStats | None = None

    def output(self, output) -> None:
        """Every request's sink (engine thread)."""
        self.events.append(("o", output))

    def stats(self, stats: object) -> None:
        """The engine's stats sink: a PoolStats ends a step or a batch of commands — the batch goes out."""
        if isinstance(stats, PoolStats):
            if stats != self._last_pool:
                self.events.append(("s", stats))
                self._last_pool = stats
            self.flush()
        else:
            self.events.append(("s", stats))

    def answer(self, call_id: int, future: Future) -> None:
        """A call's answer, sent at once (with whatever else is waiting)."""
        error = future.exception()
        self.events.append(("r", call_id, error is None, future.result() if error is None else crossing(error)))
        self.flush()

    def flush(self) -> None:
        with self.send_lock:
            if not self.open or self.broken or not self.events:
                return
            events = [self.events.popleft() for _ in range(len(self.events))]
            self.send(("batch", events))

    def send(self, message: tuple) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the frontend is gone: the main thread sees it and stops the engine
            self.broken = True


def run(settings, conn: Connection) -> None:
    """The process's entry (spawned by remote.start_core)."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    # the frontend drains the core (its "stop", or its end): a Ctrl-C or SIGTERM sent to the whole process group
    # must not kill the core before the frontend has ended the streams and the store has its turns
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from ..loading import load_engine  # (here: the spawned process imports what it runs, nothing more)

    outbox = Outbox(conn)
    try:
        engine, _, generation = in_passing_thread(load_engine, settings, outbox.stats)
    except BaseException as error:  # noqa: BLE001 - the frontend says it and exits, as serve did in one process
        logger.exception("the engine core could not start")
        outbox.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    engine.on_death.append(lambda error: died(outbox))
    outbox.send(("ready", engine.facts, generation))
    with outbox.send_lock:
        outbox.open = True
    outbox.flush()
    serve_frontend(engine, conn, outbox)
    engine.stop()
    outbox.flush()
    outbox.send(("stopped",))


def died(outbox: Outbox) -> None:
    """Engine thread, dying: its requests' error outputs first, then the word (the frontend turns /health to
    503 and drains, which stops this process)."""
    outbox.flush()
    outbox.send(("dead", ENGINE_DEAD))


def serve_frontend(engine, conn: Connection, outbox: Outbox) -> None:
    """Until "stop" or the frontend's end."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            logger.warning("the frontend is gone: stopping the engine core")
            return
        kind = message[0]
        if kind == "submit":
            _, call_id, request = message
            future = engine.submit(request, outbox.output)
            future.add_done_callback(lambda done, call_id=call_id: outbox.answer(call_id, done))
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "call":
            _, call_id, name, args, kwargs = message
            future = call(engine, name, args, kwargs)
            future.add_done_callback(lambda done, call_id=call_id: outbox.answer(call_id, done))
        elif kind == "stop":
            return
        else:
            logger.error("unknown message from the frontend: %r", kind)


def call(engine, name: str, args: tuple, kwargs: dict) -> Future:
    """One of CALLS: a session command (a future the engine resolves) or a question answered here."""
    if name not in CALLS:
        future: Future = Future()
        future.set_exception(RuntimeError(f"{name} is not a call the engine core answers"))
        return future
    if name in ANSWERED_AT_ONCE:
        future = Future()
        try:
            future.set_result(getattr(engine, name)(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - the caller gets it
            future.set_exception(error)
        return future
    owner, _, method = name.rpartition(".")
    target = engine.sessions if owner == "sessions" else engine
    try:
        return getattr(target, method)(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - raised before queueing (bad arguments): the caller gets it
        future = Future()
        future.set_exception(error)
        return future
