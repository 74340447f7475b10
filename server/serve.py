"""`linserve serve`: uvicorn running the app; on SIGTERM/SIGINT running streams end first (`abort`).

Two things uvicorn would otherwise do its own way: a malformed HTTP request is answered in the API's
JSON error shape (not plain text), and a dead engine stops the server and the process exits with
status 3 so that a supervisor (systemd, Kubernetes, compose) restarts it.
"""

from __future__ import annotations

import json
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import create_app, drain
from .settings import Settings

ENGINE_DEAD_EXIT_STATUS = 3
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # uvicorn's lines and linserve's alike


def json_400(protocol, message: str) -> None:
    body = json.dumps({"error": {"message": f"malformed HTTP request: {message}", "type": "invalid_request_error",
                                 "param": None, "code": "bad_http_request"}}).encode()
    head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    protocol.transport.write(head + body)
    protocol.transport.close()


class JsonErrorsH11(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        json_400(self, msg)


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class JsonErrorsHttpTools(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            json_400(self, msg)

    HTTP_PROTOCOL: type = JsonErrorsHttpTools
except ImportError:  # httptools is optional in uvicorn: h11 then
    HTTP_PROTOCOL = JsonErrorsH11


class DrainingServer(uvicorn.Server):
    """uvicorn waits for open connections before the lifespan ends; streams never end by themselves,
    so the engine is drained first: every stream gets its final `abort` event and closes."""

    async def shutdown(self, sockets=None) -> None:
        await drain(self.config.app)
        await super().shutdown(sockets)


def serve(settings: Settings) -> int:
    """Runs until SIGTERM/SIGINT (status 0) or until the engine dies (status 3)."""
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    app = create_app(settings)
    # log_config=None: uvicorn's loggers propagate to the root handler above, so every line has one format;
    # its access log is off — the app writes its own (linserve.access), with the request id
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=10, http=HTTP_PROTOCOL, log_config=None, access_log=False)
    server = DrainingServer(config)
    engine_dead = []

    def request_exit() -> None:
        engine_dead.append(True)
        server.should_exit = True

    app.state.request_exit = request_exit
    server.run()
    return ENGINE_DEAD_EXIT_STATUS if engine_dead else 0
