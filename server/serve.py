"""`linserve serve`: uvicorn running the app; on SIGTERM/SIGINT running streams end first (`abort`).

What uvicorn would otherwise do its own way: a malformed HTTP request is answered in the API's JSON
error shape (not plain text); connections that send no request head in time are closed and open
connections are capped (GuardedConnection); a dead engine stops the server and the process exits with
status 3 so that a supervisor (systemd, Kubernetes, compose) restarts it.
"""

from __future__ import annotations

import json
import logging
import os

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app, drain
from .settings import Settings

ENGINE_DEAD_EXIT_STATUS = 3
STARTUP_FAILED_EXIT_STATUS = 1
LINGER_S = 1.0
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # uvicorn's lines and linserve's alike


def json_error(protocol, status: bytes, code: str, message: str, linger: bool = False) -> None:
    """Answer in the API's JSON error shape straight on the transport, and close the connection (`linger`:
    half-close first and close a moment later, so a request the client is sending meanwhile does not turn
    the answer into a connection reset)."""
    kind = "invalid_request_error" if status.startswith(b"400") else "service_unavailable"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    protocol.transport.write(head + body)
    if linger and protocol.transport.can_write_eof():
        protocol.transport.write_eof()
        protocol.loop.call_later(LINGER_S, protocol.transport.close)
    else:
        protocol.transport.close()


class GuardedConnection:
    """What every connection gets, whatever HTTP parser runs it:
    - a request head (request line and headers) must arrive within `head_timeout_s` of the connection
      opening or of its previous response ending, else the connection is closed: slowloris clients and
      idle sockets cannot hold the server's file descriptors;
    - beyond `max_connections` open connections a new one is answered 503 at once and closed;
    - a malformed request is answered in the API's JSON error shape (not uvicorn's plain text)."""

    head_timeout_s = 5.0
    max_connections = 1000
    retry_after_s = 1

    refused = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.refused = True  # what it sends is never read: answered already
            json_error(self, b"503 Service Unavailable", "too_many_connections",
                       f"the server holds its maximum of {self.max_connections} connections; retry later",
                       linger=True)
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head has the same deadline as the first's

    def _arm_head_timer(self) -> None:
        armed_for = self.cycle  # a new request replaces the cycle: then the head arrived in time
        self.loop.call_later(self.head_timeout_s, self._head_deadline, armed_for)

    def _head_deadline(self, armed_for) -> None:
        if self.cycle is armed_for and (armed_for is None or armed_for.response_complete):
            if not self.transport.is_closing():
                self.transport.close()

    def send_400_response(self, msg: str) -> None:
        json_error(self, b"400 Bad Request", "bad_http_request", f"malformed HTTP request: {msg}")


class GuardedH11(GuardedConnection, H11Protocol):
    pass


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpTools(GuardedConnection, HttpToolsProtocol):
        pass

    HTTP_PROTOCOL: type = GuardedHttpTools
except ImportError:  # httptools is optional in uvicorn: h11 then
    HTTP_PROTOCOL = GuardedH11


def connection_limit(wanted: int) -> int:
    """`wanted` connections, within what the process may open: the soft file limit is raised to the hard
    one, and a few hundred descriptors stay free for everything else (files, the store, the engine)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    except (ImportError, ValueError, OSError):
        return wanted
    allowed = max(16, soft - 256)
    if wanted > allowed:
        logging.getLogger(__name__).warning("max_connections %d exceeds what %d file descriptors allow: %d",
                                            wanted, soft, allowed)
    return min(wanted, allowed)


def protocol_for(settings: Settings) -> type:
    limit = connection_limit(settings.max_connections)
    return type(HTTP_PROTOCOL.__name__, (HTTP_PROTOCOL,), {"head_timeout_s": settings.header_timeout_s,
                                                           "max_connections": limit})


class DrainingServer(uvicorn.Server):
    """uvicorn waits for open connections before the lifespan ends; streams never end by themselves,
    so the engine is drained first: every stream gets its final `abort` event and closes."""

    async def shutdown(self, sockets=None) -> None:
        await drain(self.config.app)
        await super().shutdown(sockets)


class UvicornLoggerName(logging.Filter):
    """uvicorn logs its start, stop and errors alike as `uvicorn.error`: those lines read `uvicorn`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def serve(settings: Settings) -> int:
    """Runs until SIGTERM/SIGINT (status 0) or until the engine dies (status 3). With `api_servers` > 1 this
    process supervises the engine core and the frontends (frontends.py)."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(UvicornLoggerName())
    if settings.engine_placement() > 1:
        from .frontends import supervise

        return supervise(settings)
    app = create_app(settings)
    if settings.engine_placement():  # the core first: its start-up checks decide before the HTTP side starts
        from .engine_process.remote import spawn_checked

        ours, process, refused = spawn_checked(settings)  # (Ctrl-C or SIGTERM meanwhile: 0, the core killed)
        if refused is not None:
            return refused
        app.state.core_started = (ours, process)
        lower_priority(settings.frontend_nice)  # (after the core's spawn: it keeps this process's priority)
    return run_app(settings, app)


def lower_priority(increment: int) -> None:
    """This frontend's thread (and the threads it starts from now on) `increment` nice levels below the engine
    core: on a host with few CPUs the core's second kernel thread, woken for a step's parallel region, preempts the
    frontend's token work instead of waiting behind it (docs/benchmarks.md, "The frontend a few nice levels below
    the core"). Linux's nice is per thread; a limit that refuses it leaves the priority as it was."""
    if increment <= 0:
        return
    try:
        os.nice(increment)
    except OSError as error:
        logging.getLogger("linserve.server").info("frontend priority left as it was: %s", error)


def run_app(settings: Settings, app, sockets: list | None = None) -> int:
    """uvicorn serving `app` (on `sockets` if given: a frontend of several, on the port they share)."""
    # log_config=None: uvicorn's loggers propagate to the root handler above, so every line has one format;
    # its access log is off — the app writes its own (linserve.access), with the request id
    protocol = protocol_for(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=10, http=protocol, log_config=None, access_log=False,
                            limit_concurrency=protocol.max_connections + 1)  # (this guard answers first)
    server = DrainingServer(config)
    engine_dead = []

    def request_exit() -> None:
        engine_dead.append(True)
        server.should_exit = True

    app.state.request_exit = request_exit
    if not settings.engine_placement():  # the engine in this process: torch is loaded here
        from .engine.cpu_threads import one_thread_here

        one_thread_here()  # the event loop's torch ops, if any: the engine's OpenMP team stays the only one
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # Ctrl-C: asyncio re-raises the SIGINT once uvicorn has shut down cleanly
        pass
    if not server.started and not engine_dead:
        return STARTUP_FAILED_EXIT_STATUS
    return ENGINE_DEAD_EXIT_STATUS if engine_dead else 0
