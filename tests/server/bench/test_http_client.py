"""`linserve bench`'s HTTP client on answers framed byte by byte as servers may frame them: events split anywhere
across writes, bodies by length, by chunks or by the connection's end, answers cut short, malformed or never sent.
(The client against a real `linserve serve`: test_bench.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from linserve.server.bench.client import LoadSpec, RequestRecord, TokenEvents, stream_one
from linserve.server.bench.http_client import Client


def chunked(*pieces: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces] + [b"0\r\n\r\n"]


def events(count: int) -> bytes:
    lines = [b"data: " + json.dumps({"choices": [{"text": f"t{i}"}]}).encode() + b"\n\n" for i in range(count)]
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": count}}
    return b"".join(lines) + b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"


CLOSE = None  # in an answer's writes: the server closes the connection there


async def scripted(answers: list[list[bytes | None] | None], pause_s: float = 0.002):
    """A server on 127.0.0.1 that answers the n-th request it reads, on whichever connection, with answers[n]'s
    writes (pausing between them; CLOSE closes that connection); an answer None: the request read, never answered.
    Returns (server, url, requests seen)."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while len(seen) < len(answers):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                seen.append(head + await reader.readexactly(length))
                writes = answers[len(seen) - 1]
                if writes is None:
                    await reader.read()  # (until the client gives up and closes)
                    return
                for piece in writes:
                    if piece is CLOSE:
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(pause_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/prefix", seen


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_events_split_anywhere_are_each_counted_once_as_they_arrive():
    body = events(5)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]  # lines and chunk framing cut mid-way
    stream = b"".join([head, *chunked(*pieces)])

    async def go():
        server, url, seen = await scripted([[stream[i : i + 11] for i in range(0, len(stream), 11)]])
        async with server, Client(url, {"Authorization": "Bearer k"}, 10) as client:
            record = await stream_one(client, LoadSpec(url, max_tokens=5), "m", "p", 0.0, 1)
        return record, seen

    record, seen = run(go())
    assert record.ok and record.error is None and record.status == 200
    assert (record.prompt_tokens, record.completion_tokens, len(record.token_times)) == (3, 5, 5)
    assert record.token_times == sorted(record.token_times) and record.token_times[0] < record.token_times[-1]
    (request,) = seen
    assert request.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k" in request
    assert json.loads(request.split(b"\r\n\r\n", 1)[1])["stream"] is True


def test_a_connection_is_kept_for_the_next_request_unless_the_server_closes_it():
    body = events(2)
    ok = [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)]
    last = [b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)]

    async def go():
        server, url, seen = await scripted([ok, last, ok + [CLOSE], ok])
        async with server, Client(url, {}, 10) as client:
            records = [await stream_one(client, LoadSpec(url), "m", "p", 0.0, i) for i in range(3)]
            await asyncio.sleep(0.1)  # the server closes the kept connection meanwhile
            records.append(await stream_one(client, LoadSpec(url), "m", "p", 0.0, 3))
            return records, client.opened, len(seen)

    records, opened, requests = run(go())
    assert [r.ok and len(r.token_times) == 2 for r in records] == [True] * 4
    assert opened == 3 and requests == 4  # one for the first two, one after "connection: close", one after a close


def test_an_error_answer_keeps_its_body_by_length_or_to_the_connection_end():
    error = json.dumps({"error": {"message": "max_tokens must be <= 10"}}).encode()

    async def go(answer: bytes):
        server, url, _ = await scripted([[answer]])
        async with server, Client(url, {}, 10) as client:
            return await stream_one(client, LoadSpec(url), "m", "p", 0.0, 1)

    by_length = run(go(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(error), error)))
    by_close = run(go(b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\n\r\n" + error))
    for record in (by_length, by_close):
        assert record.status == 400 and not record.ok and "max_tokens must be <= 10" in record.error


def test_an_answer_cut_short_malformed_or_never_sent_fails_its_record_only():
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    good = [head, *chunked(events(1))]

    async def go(answer, timeout_s=10.0):
        server, url, _ = await scripted([answer, good])
        async with server, Client(url, {}, timeout_s) as client:
            first = await stream_one(client, LoadSpec(url, timeout_s=timeout_s), "m", "p", 0.0, 1)
            second = await stream_one(client, LoadSpec(url, timeout_s=timeout_s), "m", "p", 0.0, 2)
            return first, second, client.opened

    cut, after, opened = run(go([head, chunked(events(3))[0][:40], CLOSE]))
    assert not cut.ok and cut.error.startswith("HTTPFailure: the server closed the connection")
    assert after.ok and opened == 2  # the next request on a new connection
    bad, after, _ = run(go([head, *chunked(b"data: {not json\n\n")]))
    assert not bad.ok and bad.error.startswith("JSONDecodeError") and after.ok
    broken, _, _ = run(go([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"]))
    assert not broken.ok and broken.error.startswith("HTTPFailure: a malformed HTTP answer")
    silent, _, _ = run(go(None, timeout_s=0.5))
    assert silent.error.startswith("TimeoutError") and silent.end - silent.start >= 0.5


def test_lines_after_done_and_other_fields_are_ignored():
    record = RequestRecord(start=0.0)
    handler = TokenEvents(record, started=1.0)
    for line in (b": keep-alive comment", b"event: message", b'data: {"choices": [{"text": "a"}]}', b"",
                 b"data: [DONE]", b'data: {"choices": [{"text": "b"}]}'):
        handler(line, 1.5)
    assert record.token_times == [0.5]


def test_only_http_urls():
    with pytest.raises(ValueError, match="not an http"):
        Client("ftp://host/x", {}, 1)
