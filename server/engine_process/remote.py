"""A frontend's engine when the engine core runs in a process of its own: `RemoteEngine` has the surface the
API uses of the in-process `Engine` — submit, abort, sessions, the questions /ready asks, facts, grammars,
alive, on_death, stop — and carries each over the channel (channel.py).

The core's batches are read by the frontend's event loop itself (loop_link.py: no thread between the socket
and the loop) — or, where no loop is given (tests, tools), by a reader thread: each output goes to its
request's sink (the same sinks as in one process: OutputStream hands them to the event loop), each stats object
to the metrics, each answer to its future. The core's end — its "dead" word, or its connection closing without
"stopped" — fails every pending call and every open request (finish reason `error`) and runs `on_death`:
/health and /ready turn 503 and the server exits for a restart, as when the engine thread dies in one process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from ..engine.command_queue import ENGINE_DEAD
from ..engine.proc_stat import stat_fields
from ..engine.types import EngineError, EngineFacts, EngineRequest, FinishReason, PoolStats, RequestOutput, StepStats
from . import channel, core_main
from .loop_link import LoopLink

logger = logging.getLogger("linserve.server.engine_process")

STOP_WAIT_S = 60.0  # the core's drain: running requests aborted, the session store flushed
START_POLL_S = 0.5
ANSWER_WAIT_S = 10.0  # a question (/ready's) the core answers at once


@dataclass
class OpenRequest:
    sink: Callable[[RequestOutput], None]
    rows: int
    finished: set[int] = field(default_factory=set)


class RemoteSessions:
    """`engine.sessions` across the boundary: each command a call whose future the core's answer resolves."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Callable[..., Future]:
        return lambda *args, **kwargs: self._engine.call(f"sessions.{name}", *args, **kwargs)


class RemoteEngine:
    """`loop`: the event loop that reads and writes the connection (the frontend's; everything that waits on the
    core's answers — `stop`, the questions — must then run off that loop's thread, as the app's do); None: a
    reader thread reads it and every thread writes it under a lock."""

    def __init__(self, conn: Connection, process, facts: EngineFacts, tokenizer,
                 stats_sink: Callable[[object], None], on_counted: Callable[[str, str], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.conn, self.process, self.facts, self.tokenizer = conn, process, facts, tokenizer
        self.stats_sink = stats_sink
        # N > 1: a request some frontend counted (set before the reader starts: the core may have sent some)
        self.on_counted = on_counted
        self.sessions = RemoteSessions(self)
        self.on_death: list[Callable[[BaseException], None]] = []
        self.death: BaseException | None = None
        self._open: dict[str, OpenRequest] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()  # orders registering against the core's death
        self._stopping = False
        self._stopped = threading.Event()
        self._grammars = None
        self._grammars_lock = threading.Lock()
        self._link: LoopLink | None = None
        if loop is not None:
            self._link = LoopLink(conn, loop, self._handle, self._link_closed)
            self._link.attach()
        else:
            threading.Thread(target=self._read, name="linserve-engine-channel", daemon=True).start()

    # ---------------------------------------------------------------- the engine's surface
    @property
    def alive(self) -> bool:
        return self.death is None and self.process.is_alive()

    def submit(self, request: EngineRequest, sink: Callable[[RequestOutput], None]) -> Future:
        return self._ask("submit", request, opening=(request.request_id, OpenRequest(sink, request.params.n)))

    def abort(self, request_id: str) -> None:
        if self.death is None:
            self._send(("abort", request_id))

    def call(self, name: str, *args, **kwargs) -> Future:
        return self._ask("call", name, args, kwargs)

    def counts(self) -> Future:
        return self.call("counts")

    def count_request(self, endpoint: str, status: str) -> None:
        """An answered HTTP request, told to every frontend through the core (N > 1: each /metrics counts all)."""
        if self.death is None:
            try:
                self._send(("counted", endpoint, status))
            except EngineError:
                pass

    def sync(self) -> None:
        """Returns once the core has handled everything sent before (bounded: a slow core is not waited on)."""
        self._answer("sync")

    def slot_accounting(self) -> Future:
        return self.call("slot_accounting")

    def store_status(self) -> dict | None:
        return self._answer("store_status")

    def describe_speculation(self) -> dict | None:
        return self._answer("describe_speculation")

    def describe_decode_step(self) -> dict | None:
        return self._answer("describe_decode_step") if self.facts.decode_step else None

    @property
    def grammars(self):
        """Structured outputs' grammars compile here (a bad one is the frontend's 400); the core gets their
        source and builds the token masks itself."""
        from ..engine.grammar import GrammarCompiler

        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.facts.vocab_size)
        return self._grammars

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Drain the core (it aborts what runs, flushes the session store) and wait for its exit (not on the
        loop that reads the connection: its "stopped" could not arrive)."""
        if self._link is not None and self._link.on_loop:
            raise RuntimeError("RemoteEngine.stop() waits for the core: call it off the event loop's thread")
        self._stopping = True
        if self.process.is_alive():  # (also after its engine died: the core still drains the store and exits)
            try:
                self._send(("stop",))
                self._stopped.wait(timeout)
            except EngineError:
                pass
        self.process.join(timeout)
        if self.process.is_alive():
            logger.error("the engine core did not stop within %.0f s: killing it", timeout)
            self.process.kill()
            self.process.join(5)

    # ---------------------------------------------------------------- internals
    def _answer(self, name: str):
        if self.death is not None:
            return None
        if self._link is not None and self._link.on_loop:  # the answer would arrive on this very thread
            logger.warning("%s asked of the engine core on the event loop's thread: no answer", name)
            return None
        try:
            return self.call(name).result(ANSWER_WAIT_S)
        except Exception:  # noqa: BLE001 - the core is gone or slow: the question has no answer now
            return None

    def _ask(self, kind: str, *payload, opening: tuple[str, OpenRequest] | None = None) -> Future:
        """Send a message whose answer resolves the returned future (`opening`: a request's sink, registered
        before it can produce outputs and dropped again if the core refuses it)."""
        future: Future = Future()
        with self._state_lock:
            if self.death is not None:
                future.set_exception(EngineError(ENGINE_DEAD, kind="dead"))
                return future
            call_id = next(self._ids)
            self._calls[call_id] = future
            if opening is not None:
                self._open[opening[0]] = opening[1]
        if opening is not None:
            future.add_done_callback(lambda done: self._refused(opening[0], done))
        try:
            self._send((kind, call_id, *payload))
        except EngineError as error:  # the core is gone: the reader fails everything else pending
            self._calls.pop(call_id, None)
            if not future.done():
                future.set_exception(error)
        return future

    def _refused(self, request_id: str, future: Future) -> None:
        if future.exception() is not None:
            self._open.pop(request_id, None)

    def _send(self, message: tuple) -> None:
        try:
            if self._link is not None:
                self._link.send(message)
                return
            with self._send_lock:
                channel.send(self.conn, message)
        except (OSError, ValueError, RuntimeError) as error:  # (RuntimeError: the loop is closed)
            raise EngineError(ENGINE_DEAD, kind="dead") from error

    def _read(self) -> None:
        """The reader thread (no loop given)."""
        try:
            while True:
                message = self.conn.recv()
                self._handle(message)
                if message[0] == "stopped":
                    return
        except (EOFError, OSError) as error:
            self._link_closed(error)

    def _handle(self, message: tuple) -> None:
        if message[0] == "batch":
            self._dispatch(message[1])
        elif message[0] == "dead":
            self._die(RuntimeError(message[1]))
        elif message[0] == "stopped":
            self._stopped.set()
            if self._link is not None:
                self._link.close()

    def _link_closed(self, error: BaseException) -> None:
        if not self._stopped.is_set():
            self.process.join(0.5 if self._link is not None else 1)  # (for its exit status; the loop waits less)
            self._die(RuntimeError(f"the engine core process ended (exit status {self.process.exitcode})"), error)

    def _dispatch(self, events: list[tuple]) -> None:
        for event in events:
            tag = event[0]
            if tag == "o":
                values = event[1]  # (RequestOutput's fields in order: core_main.Outbox.output)
                entry = self._open.get(values[0])
                if entry is None:
                    continue
                output = RequestOutput(*values)
                if output.finish_reason is not None:  # (`finished` without its call: a row a step)
                    entry.finished.add(output.index)
                    if len(entry.finished) >= entry.rows:
                        del self._open[output.request_id]
                entry.sink(output)
            elif tag == "t":
                self.stats_sink(StepStats(*event[1]))
            elif tag == "p":
                self.stats_sink(PoolStats(*event[1]))
            elif tag == "s":
                self.stats_sink(event[1])
            elif tag == "c":
                if self.on_counted is not None:
                    self.on_counted(event[1], event[2])
            else:
                _, call_id, ok, value = event
                future = self._calls.pop(call_id, None)
                if future is not None:
                    future.set_result(value) if ok else future.set_exception(value)

    def _die(self, error: BaseException, cause: BaseException | None = None) -> None:
        with self._state_lock:
            if self.death is not None:
                return
            self.death = error
            calls, self._calls = self._calls, {}
            opened, self._open = self._open, {}
        if not self._stopping:
            logger.critical("the engine core has died: %s", error, exc_info=cause)
        for future in calls.values():
            future.set_exception(EngineError(ENGINE_DEAD, kind="dead"))
        for request_id, entry in opened.items():
            for index in sorted(set(range(entry.rows)) - entry.finished):
                try:
                    entry.sink(RequestOutput(request_id, index, None, "", finish_reason=FinishReason.ERROR,
                                             error=ENGINE_DEAD))  # (as the engine thread's death says it)
                except Exception:  # noqa: BLE001 - best effort: the core is gone
                    logger.exception("output sink failed while the engine core was gone")
        self._stopped.set()
        if not self._stopping:
            for callback in self.on_death:
                try:
                    callback(error)
                except Exception:  # noqa: BLE001
                    logger.exception("on_death callback failed")


def spawn_core(settings, conns: list[Connection] | None = None, target: Callable = core_main.run):
    """Start the engine core process (`target(settings, connections)`: core_main.run) with `conns` (the core's ends
    of the frontends' pipes): returns the process; without `conns`, with one new pipe: (our end, the process).
    The core checks what needs torch first (preflight.check_engine) and says "checked" on its first connection."""
    context = multiprocessing.get_context("spawn")  # (torch and threads: never fork)
    ours = None
    if conns is None:
        ours, theirs = context.Pipe(duplex=True)
        conns = [theirs]
    process = context.Process(target=target, args=(settings, conns), name="linserve-engine-core")
    process.start()
    if ours is None:
        return process
    conns[0].close()
    return ours, process


def spawn_checked(settings, conns: list[Connection] | None = None, first: Connection | None = None):
    """spawn_core(settings, conns), then wait until the core has made its start-up checks: (our end of its first
    connection — `first` where `conns` are given —, the process, refused). `refused` is None once it says
    "checked"; its exit status if it ended first (2: a refused setting or checkpoint, whose one `error:` line it
    printed); 0 if Ctrl-C or SIGTERM came meanwhile — the core killed (it ignores both: its frontends drain it,
    and there is nothing to drain yet). `serve` exits with what it returns.

    Both signals are held from before the spawn: one that ended this process while `Process.start` writes the
    child its start (its pickled target and arguments) would leave the child an EOFError's traceback on the
    shared stderr and an orphan; held, it kills the child once started. The handlers in place before are back on
    return."""
    held: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum))
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        spawned = spawn_core(settings, conns)
        ours, process = spawned if conns is None else (first, spawned)
        for signum in previous:  # (SIGTERM as Ctrl-C, until checked)
            signal.signal(signum, signal.default_int_handler)
        if held:
            raise KeyboardInterrupt
        return ours, process, _checked(ours, process)
    except KeyboardInterrupt:
        for signum in previous:  # (a second signal while the core is killed changes nothing)
            signal.signal(signum, signal.SIG_IGN)
        process.kill()
        process.join(5)
        return ours, process, 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _checked(ours: Connection, process) -> int | None:
    try:
        while not ours.poll(START_POLL_S):
            if not process.is_alive():
                process.join(5)
                return process.exitcode or 1
        message = ours.recv()
    except EOFError:
        process.join(5)
        return process.exitcode or 1
    if message[0] != "checked":
        raise RuntimeError(f"the engine core said {message[0]!r} before its start-up checks")
    return None


def start_core(settings, stats_sink: Callable[[object], None], target: Callable = core_main.run,
               loop: asyncio.AbstractEventLoop | None = None):
    """Spawn the engine core process and wait until it is ready: (RemoteEngine, tokenizer, GenerationDefaults). A
    core that cannot start raises with its reason."""
    ours, process = spawn_core(settings, target=target)
    return connect_core(settings, ours, process, stats_sink, loop=loop)


def connect_core(settings, ours: Connection, process, stats_sink: Callable[[object], None],
                 on_counted: Callable[[str, str], None] | None = None, loop: asyncio.AbstractEventLoop | None = None):
    """Wait for the core's "ready" (`process`: a multiprocessing.Process, or a CoreProcess where the core is not
    this process's child): (RemoteEngine, tokenizer, GenerationDefaults) — the tokenizer is the core's, pickled.
    `on_counted`: where the requests other frontends counted go (N > 1); `loop`: the event loop that reads and
    writes the connection (RemoteEngine)."""
    # meanwhile, what unpickling the core's tokenizer imports (1-2 s of transformers' modules), off the critical path
    import transformers.tokenization_utils_tokenizers  # noqa: F401

    message = ("checked",)
    while message[0] == "checked":  # (the first connection has it before "ready", unless `serve` read it)
        while not ours.poll(START_POLL_S):
            if not process.is_alive():
                raise RuntimeError(f"the engine core process ended while starting (exit status {process.exitcode})")
        try:
            message = ours.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(
                f"the engine core process ended while starting (exit status {process.exitcode})") from None
    if message[0] != "ready":
        process.join(10)
        raise RuntimeError(f"the engine core could not start: {message[1]}")
    _, facts, generation, tokenizer = message
    return RemoteEngine(ours, process, facts, tokenizer, stats_sink, on_counted, loop), tokenizer, generation


class CoreProcess:
    """The engine core seen from a frontend that is not its parent (`api_servers` > 1: `serve` spawned both):
    what RemoteEngine asks of a multiprocessing.Process, by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode = None  # (not this process's child: its status is the supervisor's to read)

    def is_alive(self) -> bool:
        fields = stat_fields(self.pid)
        return bool(fields) and fields[0] not in ("Z", "X")

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def kill(self) -> None:
        """Not a frontend's to do: the core serves the other frontends; `serve` ends it after them all."""
