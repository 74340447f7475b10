"""`linserve serve --api-servers N` (N > 1): this process binds the port, spawns the engine core and N
frontend processes, and supervises them.

    serve (this process: binds host:port, forwards SIGTERM/SIGINT, reads exit statuses)
     ├── engine core       core_main.run(settings, [conn_1 … conn_N]): device, model, pool, scheduler, sessions
     ├── frontend 1        uvicorn on the shared listening socket; its engine is a RemoteEngine on conn_1
     ├── …
     └── frontend N

Every frontend accepts on the same socket (the kernel hands each connection to one of them) and talks to the
core through its own connection (engine_process/channel.py). The core sends each frontend its requests'
outputs and every step's stats, and tells every frontend the HTTP requests each one counted, so any frontend's
`/metrics` shows the whole server; `process_*` there sums this process and its children.

Stopping: SIGTERM or SIGINT here is passed to every frontend; each drains its streams (finish reason `abort`)
and tells the core "stop"; once all have, the core stops the engine, flushes the session store and exits.
A frontend that exits on its own (its engine died: status 3, or it could not start) ends the server: the
others are stopped the same way and `serve` exits with that status, for a supervisor to restart it.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
from multiprocessing.connection import wait

from .engine_process.remote import spawn_checked
from .settings import Settings

logger = logging.getLogger("linserve.server.frontends")

CORE_STOP_WAIT_S = 90.0  # after the frontends: the engine's drain and the store's flush
FRONTEND_STOP_WAIT_S = 90.0  # a frontend's drain (uvicorn's graceful shutdown, then the core's "stopped")
BACKLOG = 2048


def listening_socket(settings: Settings) -> socket.socket:
    """The port every frontend accepts on (bound here, inherited by each)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def frontend_main(settings: Settings, conn, core_pid: int, sock: socket.socket, index: int) -> None:
    """One frontend process (spawned): the app with its engine across `conn`, served on the shared socket."""
    import os

    from .app import create_app
    from .engine_process.remote import CoreProcess
    from .serve import UvicornLoggerName, lower_priority, run_app

    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s [frontend {index}] "
                        "%(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(UvicornLoggerName())
    app = create_app(settings)
    app.state.core_link = (conn, CoreProcess(core_pid))
    lower_priority(settings.frontend_nice)
    status = run_app(settings, app, sockets=[sock])
    logging.shutdown()
    os._exit(status)  # (as `serve` ends: no interpreter teardown)


def supervise(settings: Settings) -> int:
    """Runs until SIGTERM/SIGINT (status 0), or until a frontend ends on its own (its status: 3 when the engine
    died)."""
    context = multiprocessing.get_context("spawn")  # (torch and threads: never fork)
    sock = listening_socket(settings)
    pipes = [context.Pipe(duplex=True) for _ in range(settings.engine_placement())]
    stopping = threading.Event()

    def on_signal(signum, frame) -> None:
        stopping.set()

    # from here on a signal only says "stop" (a process being spawned is never cut off halfway through its start)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _, core, refused = spawn_checked(settings, [theirs for _, theirs in pipes], first=pipes[0][0])
        frontends = []
        if refused is None:  # its start-up checks first: a refusal is one line, status 2
            for index, (ours, _) in enumerate(pipes, 1):
                frontend = context.Process(target=frontend_main, args=(settings, ours, core.pid, sock, index),
                                           name=f"linserve-frontend-{index}")
                frontend.start()
                frontends.append(frontend)
        for ours, theirs in pipes:
            ours.close()
            theirs.close()
        sock.close()
        if refused is not None:
            return refused
        logger.info("engine core (pid %d) and %d frontends (pids %s) on %s:%d", core.pid, len(frontends),
                    ", ".join(str(f.pid) for f in frontends), settings.host, settings.port)
        return watch(frontends, core, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def watch(frontends: list, core, stopping: threading.Event) -> int:
    """Until `stopping` (SIGTERM/SIGINT: status 0) or a process ends on its own."""
    by_sentinel = {process.sentinel: process for process in (*frontends, core)}
    ended = []
    while not stopping.is_set() and not ended:
        ended = [by_sentinel[sentinel] for sentinel in wait(list(by_sentinel), timeout=0.2)]
    on_its_own = not stopping.is_set()
    if on_its_own:
        for process in ended:
            process.join(1)  # (its sentinel closes a moment before its exit status can be read)
        if any(process is not core for process in ended):
            first = next(process for process in ended if process is not core)
            logger.error("%s ended (status %s): stopping the server", first.name, first.exitcode)
        else:  # each frontend hears it on its connection: /health turns 503, it drains and exits 3
            core.join(1)
            logger.critical("the engine core (pid %d) ended with status %s: the frontends stop", core.pid,
                            core.exitcode)
            wait([f.sentinel for f in frontends], timeout=FRONTEND_STOP_WAIT_S)
    stop(frontends, core)
    if not on_its_own:
        return 0
    # a dead engine: its frontends exit 3; a frontend that could not start: 1; one killed by a signal: 1
    code = next((f.exitcode for f in frontends if f.exitcode not in (0, None, -signal.SIGTERM)), 3)
    return code if code > 0 else 1


def stop(frontends: list, core) -> None:
    """Each frontend drains (SIGTERM: uvicorn's graceful shutdown, which tells the core "stop"); then the core."""
    for frontend in frontends:
        if frontend.is_alive():
            frontend.terminate()
    for frontend in frontends:
        frontend.join(FRONTEND_STOP_WAIT_S)
        if frontend.is_alive():
            logger.error("%s did not stop within %.0f s: killing it", frontend.name, FRONTEND_STOP_WAIT_S)
            frontend.kill()
            frontend.join(5)
    core.join(CORE_STOP_WAIT_S)  # (every connection has said stop or closed: it drains and exits)
    if core.is_alive():
        logger.error("the engine core did not stop within %.0f s: killing it", CORE_STOP_WAIT_S)
        core.kill()
        core.join(5)
