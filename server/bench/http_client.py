"""`linserve bench`'s HTTP/1.1 client: keep-alive connections to one server, each answer parsed by httptools inside
the event loop's data callback, and each line of a streamed (server-sent events) body handed to the request's own
handler right there, stamped with the time its bytes arrived — no task woken, future resolved, stream reader fed or
coroutine resumed per token. A load generator that shares the server's host takes its CPU from the server: aiohttp's
client spent 25–33 µs of CPU a streamed token at 32 streams on 2 cores, this one 14–22 (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

KEPT_BODY_BYTES = 1 << 20  # a body that is not streamed line by line (an error, a model list) is kept up to this

LineHandler = Callable[[bytes, float], None]  # (one line of the body without its "\n", perf_counter when it arrived)


class HTTPFailure(ConnectionError):
    """The connection closed before the answer ended, or the answer broke HTTP's framing."""


class Answer:
    """One request's answer, from httptools' callbacks: the status, then the body — line by line to `on_line` when
    the status is 200 and there is a handler, else kept (up to KEPT_BODY_BYTES)."""

    def __init__(self, on_line: LineHandler | None, done: asyncio.Future) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.on_line, self.done = on_line, done
        self.status = 0
        self.body = bytearray()
        self.pending = b""  # a line's start, until its "\n" arrives
        self.arrived = 0.0
        self.framed = False  # a Content-Length or chunked body; else the body ends when the server closes
        self.keep_alive = False  # the server keeps the connection for another request (read with the headers)
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.status != 200:
            self.on_line = None

    def on_body(self, data: bytes) -> None:
        if self.on_line is None:
            self.body += data[: KEPT_BODY_BYTES - len(self.body)]
            return
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            self.on_line(line, self.arrived)

    def on_message_complete(self) -> None:
        if self.pending and self.on_line is not None:  # a last line without its newline
            self.on_line(self.pending, self.arrived)
            self.pending = b""
        self.complete = True
        if not self.done.done():
            self.done.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


class Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer fed to that request's `Answer`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.answer: Answer | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, answer: Answer) -> None:
        self.answer = answer
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None or answer.complete:  # bytes no request asked for: this connection is not to be reused
            self.close()
            return
        answer.arrived = time.perf_counter()
        try:
            answer.parser.feed_data(data)
        except httptools.HttpParserCallbackError as error:  # the line handler's own error (a malformed event)
            answer.fail(error.__context__ or error)
            self.close()
        except httptools.HttpParserError as error:
            answer.fail(HTTPFailure(f"a malformed HTTP answer: {error}"))
            self.close()

    def connection_lost(self, error: Exception | None) -> None:
        self.closed = True
        answer = self.answer
        if answer is None or answer.complete:
            return
        if answer.status and not answer.framed:  # a body delimited by the connection's end: this is its end
            answer.on_message_complete()
        else:
            answer.fail(HTTPFailure("the server closed the connection before its answer ended"
                                    + (f" ({error})" if error else "")))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Client:
    """Requests to one server (`url`: scheme, host, port and an optional path prefix), as many connections as
    requests in flight, each kept open for the next request; every request (connecting included) within
    `timeout_s`. Use as `async with Client(...) as client:`."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        lines = {"Host": parts.netloc, "User-Agent": "linserve-bench", **headers}
        self.head = "".join(f"{name}: {value}\r\n" for name, value in lines.items()).encode()
        self.timeout_s = timeout_s
        self.idle: list[Connection] = []
        self.opened = 0  # connections made so far

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        while self.idle:
            self.idle.pop().close()

    async def request(self, method: str, path: str, body: bytes | None = None,
                      on_line: LineHandler | None = None) -> tuple[int, bytes]:
        """(status, kept body): a 200 answer's body goes to `on_line` line by line as it arrives when there is a
        handler (nothing is kept), any other answer's is kept."""
        head = f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode() + self.head
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        request = head + b"\r\n" + (body or b"")
        async with asyncio.timeout(self.timeout_s):
            connection = await self._connection()
            answer = Answer(on_line, asyncio.get_running_loop().create_future())
            try:
                connection.send(request, answer)
                await answer.done
            except BaseException:
                connection.close()
                raise
        connection.answer = None
        if connection.closed or not answer.keep_alive:
            connection.close()
        else:
            self.idle.append(connection)
        return answer.status, bytes(answer.body)

    async def _connection(self) -> Connection:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                return connection
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(Connection, self.host, self.port, ssl=self.ssl,
                                                     server_hostname=self.host if self.ssl else None)
        self.opened += 1
        return connection
