"""The engine core process: loads the model and runs the engine (server/engine/core.py) as `serve` would in
one process, and serves its frontends — one connection each (channel.py) — until every one has said "stop" or
is gone; then it drains as the in-process server does (running requests end with `abort`, every session turn
handed to the store is written) and exits.

Its main thread reads the frontends' messages (whichever is ready) and hands them to the engine (whose own
queue orders them); what the engine produces is collected per frontend in an `Outbox` — a request's outputs
and a call's answer in its own frontend's, the stats in every one (each frontend's /metrics shows the whole
engine) — and each outbox goes out as one message when the engine thread reports its pool after a step or a
batch of commands (written by the engine thread, or by the outboxes' thread where the engine's steps, timed both
ways, go faster so: write_handoff.py). A frontend that is gone has its running requests aborted: its clients' slots
come back.

Starting: the checks that need torch (preflight.check_engine: the device, the checkpoint, int8 where it can run)
come first — a failure is its one `error:` line on stderr and exit status 2, as `serve` reports its own checks —
then "checked" to the first frontend's connection (`serve` waits for it before it starts the HTTP side), then
the model loads and every frontend gets "ready" with the engine's facts, the generation defaults and the
tokenizer (pickled: a frontend never loads one itself, nor the transformers and torch modules loading one takes).
"""

from __future__ import annotations

import collections
import logging
import signal
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait

from ..engine import heap
from ..engine.command_queue import ENGINE_DEAD
from ..engine.cpu_threads import in_passing_thread
from ..engine.types import PoolStats, StepStats, output_values, pool_values, step_values
from . import channel
from .channel import ANSWERED_AT_ONCE, CALLS, crossing
from .write_handoff import WriteHandoff

logger = logging.getLogger("linserve.server.engine_process")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # (serve.py's)
BACKLOG_EVENTS = 4096  # an outbox holding more when a step posts: the engine thread writes it, waiting as it must


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
        self.running: dict[str, int] = {}  # this frontend's requests: rows not finished yet
        self._running_lock = threading.Lock()

    def submitted(self, request_id: str, rows: int) -> None:
        with self._running_lock:
            self.running[request_id] = rows

    def output(self, output) -> None:
        """Every request's sink (engine thread). The output crosses as its fields' tuple, which C pickles whole
        (an object's own reduction is a Python call: 0.4 µs a row a step more)."""
        self.events.append(("o", output_values(output)))
        if output.finish_reason is not None:
            with self._running_lock:
                left = self.running.get(output.request_id, 1) - 1
                if left > 0:
                    self.running[output.request_id] = left
                else:
                    self.running.pop(output.request_id, None)

    def refused(self, request_id: str, future: Future) -> None:
        if future.exception() is not None:
            with self._running_lock:
                self.running.pop(request_id, None)

    def unfinished(self) -> list[str]:
        with self._running_lock:
            return list(self.running)

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
                channel.send(self.conn, message)
        except (OSError, ValueError):  # the frontend is gone: the main thread sees it and stops the engine
            self.broken = True


class Outboxes:
    """Every frontend's outbox: the engine's stats sink (stats go to each; a PoolStats ends a step or a batch of
    commands — every outbox goes out) and the place a frontend's counted HTTP request is told to all.

    Where the engine's decode steps go faster so (`WriteHandoff`: both writers timed served), a step's outboxes are
    written by a thread of their own (`post` wakes it): pickling and writing them — and the frontend the write wakes
    — then overlap the next step's program, which runs without the GIL. Every other flush is the caller's own, at
    once.
    Either way each outbox sends its events in the order they were appended (popped and written under its lock).
    A frontend that reads more slowly than the engine steps holds the engine, as it did when the engine thread wrote
    every step: past BACKLOG_EVENTS the engine thread flushes that outbox itself (so nothing grows without bound)."""

    def __init__(self, conns: list[Connection]) -> None:
        self.all = [Outbox(conn) for conn in conns]
        self._last_pool: tuple | None = None  # the last PoolStats sent, its values
        self._posted = threading.Lock()  # released: a step's events wait for the sender (held: nothing waits)
        self._posted.acquire()
        self.handoff = WriteHandoff()
        self._decoded = False  # a decode step's StepStats came since the last PoolStats
        self._closed = False
        self._thread = threading.Thread(target=self._sender, name="linserve-outboxes", daemon=True)
        self._thread.start()

    def stats(self, stats: object) -> None:
        kind = type(stats)
        if kind is StepStats:  # (every step: its fields' tuple, as an output's)
            self._append(("t", step_values(stats)))
            self._decoded = stats.phase == "decode"
        elif kind is PoolStats:
            values = pool_values(stats)
            if values != self._last_pool:
                self._append(("p", values))
                self._last_pool = values
            self.step_done()
        else:
            self._append(("s", stats))

    def step_done(self) -> None:
        """A step's (or a batch of commands') events go out: written here, or handed to the thread."""
        decoded, self._decoded = self._decoded, False
        if self.handoff.step_ended(decoded):
            self.post()
        else:
            self.flush()

    def post(self) -> None:
        """The sender thread flushes every outbox soon (a release: one futex wake, or nothing if one is due)."""
        for outbox in self.all:
            if len(outbox.events) > BACKLOG_EVENTS:  # (its frontend reads slowly: wait for it here)
                outbox.flush()
        try:
            self._posted.release()
        except RuntimeError:  # (released already: the sender has not taken the last post yet, and will send these)
            pass

    def _sender(self) -> None:
        while True:
            self._posted.acquire()
            if self._closed:
                return
            self.flush()

    def close(self) -> None:
        """Everything appended so far sent (by the caller), and the sender thread ended."""
        self.flush()
        self._closed = True
        self.post()
        self._thread.join()

    def counted(self, endpoint: str, status: str) -> None:
        self._append(("c", endpoint, status))
        self.flush()

    def _append(self, event: tuple) -> None:
        for outbox in self.all:
            outbox.events.append(event)

    def flush(self) -> None:
        for outbox in self.all:
            outbox.flush()

    def send(self, message: tuple) -> None:
        for outbox in self.all:
            outbox.send(message)

    def opened(self) -> None:
        for outbox in self.all:
            with outbox.send_lock:
                outbox.open = True
        self.flush()


def run(settings, conns: Connection | list[Connection]) -> None:
    """The process's entry (spawned by remote.spawn_core with one frontend's connection, or by `serve` with
    `api_servers` of them)."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    # the frontend drains the core (its "stop", or its end): a Ctrl-C or SIGTERM sent to the whole process group
    # must not kill the core before the frontend has ended the streams and the store has its turns
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from ..loading import load_engine  # (here: the spawned process imports what it runs, nothing more)
    from ..preflight import check_engine

    conns = conns if isinstance(conns, list) else [conns]
    try:
        check_engine(settings)
    except (ValueError, FileNotFoundError, OSError) as error:  # as `linserve serve` reports a start-up error
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    conns[0].send(("checked",))
    outboxes = Outboxes(conns)
    try:
        engine, tokenizer, generation = in_passing_thread(load_engine, settings, outboxes.stats)
    except BaseException as error:  # noqa: BLE001 - the frontend says it and exits, as serve did in one process
        logger.exception("the engine core could not start")
        outboxes.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    engine.on_death.append(lambda error: died(outboxes))
    heap.freeze_startup_objects("engine core")  # (engine/heap.py: no 150 ms collection holds the engine thread later)
    outboxes.send(("ready", engine.facts, generation, tokenizer))
    outboxes.opened()
    serve_frontends(engine, outboxes)
    engine.stop()
    outboxes.close()
    outboxes.send(("stopped",))


def died(outboxes: Outboxes) -> None:
    """Engine thread, dying: its requests' error outputs first, then the word (each frontend turns /health to
    503 and drains, which stops this process)."""
    outboxes.flush()
    outboxes.send(("dead", ENGINE_DEAD))


def serve_frontends(engine, outboxes: Outboxes) -> None:
    """Until every frontend has said "stop" or is gone. One that stops or goes while others serve has its
    unfinished requests aborted (their outputs still reach a frontend that stopped: it waits for "stopped")."""
    listening = {outbox.conn: outbox for outbox in outboxes.all}
    while listening:
        for conn in wait(list(listening)):
            outbox = listening[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):
                logger.warning("a frontend is gone%s", "" if len(listening) > 1 else ": stopping the engine core")
                message = ("gone",)
            if message[0] in ("stop", "gone"):
                del listening[conn]
                if listening:  # the last one's are aborted by the engine's own stop
                    for request_id in outbox.unfinished():
                        engine.abort(request_id)
            else:
                handle(engine, outboxes, outbox, message)


def handle(engine, outboxes: Outboxes, outbox: Outbox, message: tuple) -> None:
    kind = message[0]
    if kind == "submit":
        _, call_id, request = message
        outbox.submitted(request.request_id, request.params.n)
        future = engine.submit(request, outbox.output)
        future.add_done_callback(lambda done, call_id=call_id: outbox.answer(call_id, done))
        future.add_done_callback(lambda done: outbox.refused(request.request_id, done))
    elif kind == "abort":
        engine.abort(message[1])
    elif kind == "call":
        _, call_id, name, args, kwargs = message
        future = call(engine, name, args, kwargs)
        future.add_done_callback(lambda done, call_id=call_id: outbox.answer(call_id, done))
    elif kind == "counted":
        outboxes.counted(message[1], message[2])
    else:
        logger.error("unknown message from a frontend: %r", kind)


def call(engine, name: str, args: tuple, kwargs: dict) -> Future:
    """One of CALLS: a session command (a future the engine resolves) or a question answered here."""
    if name not in CALLS:
        future: Future = Future()
        future.set_exception(RuntimeError(f"{name} is not a call the engine core answers"))
        return future
    if name in ANSWERED_AT_ONCE:
        future = Future()
        if name == "sync":  # answered after everything this frontend sent before it
            future.set_result(None)
            return future
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
