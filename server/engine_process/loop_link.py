"""A frontend's end of the channel (channel.py) read and written by its event loop itself: no reader thread.

With a reader thread, each core message cost the frontend a blocking read of its length, another of its body,
the thread's wake-up, the GIL handed to it and back, and `call_soon_threadsafe`'s write to the loop's self-pipe
plus the loop's read of it — per step, ~10 `futex` calls at 32 streams and 6.5 system calls a token at one
stream (`strace -c`, docs/benchmarks.md). Here the loop watches the connection's socket (`add_reader`): when it
is readable, one `recv` takes whatever has arrived — often a whole step's message, sometimes several, or part
of a large one — and each complete frame is unpickled and handed on, on the loop's own thread. A frame that takes
several reads (a session's state exported: tens of MB) is received into one buffer of its size, allocated once its
header is in (`recv_into`): a buffer grown at every read would copy it hundreds of times — 11 s of the loop for
64 MB, against 0.26 s.

Writes never block the loop: a frame goes out with `MSG_DONTWAIT`, and what the socket does not take waits,
in order, until `add_writer` says it can go. A loop blocked in a write would stop reading the core's
messages, and a core writing to it could then stop reading ours: both sides stuck. Other threads' frames
are handed to the loop (`call_soon_threadsafe`), so every frame leaves in the order it was made on its thread.

The frames are `multiprocessing.connection.Connection`'s (a signed 4-byte big-endian length, or -1 and an
8-byte length, then the bytes), so the core keeps reading and writing with `Connection`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from .channel import encode

logger = logging.getLogger("linserve.server.engine_process")

READ_BYTES = 1 << 18  # one recv: a 128-row step's message is ~10 KB
_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


def frame(message: tuple) -> bytes:
    """`message` as `Connection.recv` reads it (the channel's encoding, Connection's framing)."""
    data = encode(message)
    if len(data) > 0x7FFFFFFF:
        return _LENGTH.pack(-1) + _LONG_LENGTH.pack(len(data)) + data
    return _LENGTH.pack(len(data)) + data


class LoopLink:
    """`on_message(message)` for each message the core sends and `on_closed(error)` once when its end closes,
    both on the loop's thread; `send(message)` from any thread.

    `start()` and `close()` run on the loop (`attach` schedules `start` from another thread)."""

    def __init__(self, conn: Connection, loop: asyncio.AbstractEventLoop, on_message: Callable[[tuple], None],
                 on_closed: Callable[[BaseException], None]) -> None:
        self.conn, self.loop = conn, loop
        self.on_message, self.on_closed = on_message, on_closed
        self.fd = conn.fileno()
        # a second socket object over the same socket (its own descriptor): recv and send with flags; the
        # descriptor stays blocking (the Connection, and whatever else shares it, expect that)
        self.sock = socket.socket(fileno=os.dup(self.fd))
        self._head = b""  # the start of a frame whose header is not all here yet
        self._frame: bytearray | None = None  # a frame that takes more reads, allocated whole, and its bytes so far
        self._filled = 0
        self._out: collections.deque[memoryview] = collections.deque()  # frames (or their rest) still to send
        self._writing = False  # add_writer is watching
        self._open = False
        self._ended = False  # closed by the core (EOF) or by us
        self.thread_id: int | None = None  # the loop's thread, once started

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> None:
        """From any thread: start reading on the loop (frames sent before then go first, in order)."""
        self.loop.call_soon_threadsafe(self.start)

    def start(self) -> None:
        if self._open or self._ended:
            return
        self.thread_id = threading.get_ident()
        self._open = True
        self.loop.add_reader(self.fd, self._readable)
        self._flush()

    def close(self) -> None:
        """On the loop: stop reading and writing (frames not yet sent are dropped)."""
        if self._ended:
            return
        self._ended = True
        if self._open:
            self.loop.remove_reader(self.fd)
            if self._writing:
                self.loop.remove_writer(self.fd)
        self._writing = False
        self._out.clear()
        self.sock.close()

    @property
    def on_loop(self) -> bool:
        return self.thread_id == threading.get_ident()

    # ------------------------------------------------------------------ writing
    def send(self, message: tuple) -> None:
        """Any thread. Raises OSError once the link has ended (the core is gone), RuntimeError if the loop is
        closed."""
        if self._ended:
            raise OSError("the engine core's connection is closed")
        data = frame(message)
        if self.on_loop:
            self._queue(data)
        else:
            self.loop.call_soon_threadsafe(self._queue, data)

    def _queue(self, data: bytes) -> None:
        if self._ended:
            return
        self._out.append(memoryview(data))
        if self._open and not self._writing:
            self._flush()

    def _flush(self) -> None:
        """Send queued frames until the socket would block; then wait for it to be writable."""
        out = self._out
        try:
            while out:
                head = out[0]
                sent = self.sock.send(head, socket.MSG_DONTWAIT)
                if sent < len(head):
                    out[0] = head[sent:]
                    break
                out.popleft()
        except BlockingIOError:
            pass
        except OSError as error:  # the core is gone: its EOF (read side) fails what is pending
            logger.debug("send to the engine core failed: %s", error)
            out.clear()
        if out and not self._writing:
            self._writing = True
            self.loop.add_writer(self.fd, self._flush)
        elif not out and self._writing:
            self._writing = False
            self.loop.remove_writer(self.fd)

    # ------------------------------------------------------------------ reading
    def _readable(self) -> None:
        try:
            if self._frame is not None:  # the rest of a large frame goes straight into its place
                self._fill_frame()
                return
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            self._closed(error)
            return
        if not data:
            self._closed(EOFError("the engine core closed its connection"))
            return
        if self._head:
            data = self._head + data  # (a header received in part: a few bytes)
            self._head = b""
        view = memoryview(data)  # (usually whole frames, parsed where they landed)
        end, at = len(view), 0
        while end - at >= 4:
            size = _LENGTH.unpack_from(view, at)[0]
            start = at + 4
            if size == -1:
                if end - at < 12:
                    break
                size = _LONG_LENGTH.unpack_from(view, start)[0]
                start += 8
            if end - start < size:  # a frame that needs more reads: its whole size allocated once, filled
                self._frame, self._filled = bytearray(size), end - start  # in place (no copy per read)
                self._frame[:self._filled] = view[start:end]
                return
            at = start + size
            self._deliver(view[start:at])
            if self._ended:  # ("stopped", or the message ended the link)
                return
        self._head = bytes(view[at:]) if at < end else b""

    def _fill_frame(self) -> None:
        frame, filled = self._frame, self._filled
        received = self.sock.recv_into(memoryview(frame)[filled:])
        if not received:
            self._closed(EOFError("the engine core closed its connection"))
            return
        self._filled = filled = filled + received
        if filled == len(frame):
            self._frame = None
            self._deliver(frame)

    def _deliver(self, data) -> None:
        try:
            self.on_message(pickle.loads(data))
        except Exception:  # noqa: BLE001 - one message's failure must not stop the channel
            logger.exception("a message from the engine core could not be handled")

    def _closed(self, error: BaseException) -> None:
        self.close()
        self.on_closed(error)

