"""A server process's heap: freed memory given back to the OS after a very large request, and the objects startup
made kept out of the garbage collector's walks.

glibc keeps freed memory in its arenas (and raises its mmap threshold after large frees), so one
multi-megabyte prompt — hundreds of MB while it is tokenized, tens of MB of token lists while it is
prefilled — would stay in the process's RSS for good. `trim()` asks glibc to return it; elsewhere it
does nothing. Called only after requests past `LARGE_TOKENS`, so its few milliseconds are rare.

CPython's collector runs as objects are allocated, and its full (generation 2) collection walks every tracked object
in the process: a started server holds ~250,000 (torch, transformers, FastAPI, pydantic, the model's modules), which
one walk takes 150-160 ms over on a 2-core host. A frontend's event loop, or the engine thread holding the GIL, stops
for all of it: 3,000 requests at 32 streams (`linserve bench --concurrency 32 --requests 3000 --max-tokens 16`)
triggered one 163 ms generation-2 pause in the frontend and 3-8 ms generation-1 pauses (docs/engine.md, "The
collector's pauses"). `freeze_startup_objects()` — at the end of startup, in every server process — collects once
and then moves everything alive to the collector's permanent generation (`gc.freeze`), which it never walks; later
collections see only what serving made. The frozen objects live as long as the process serves; an app that ends
unfreezes them (a test process starts many servers, whose cycles must stay collectable).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time

logger = logging.getLogger(__name__)

LARGE_TOKENS = 1 << 16
LARGE_TEXT_CHARS = 1 << 20

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


def trim() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)


def freeze_startup_objects(process: str) -> int:
    """Collect startup's garbage once, then freeze what is left out of every later collection (the count frozen)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("%s: %d objects made at startup frozen out of the garbage collector's walks (%.0f ms)", process,
                frozen, 1e3 * (time.perf_counter() - started))
    return frozen


def unfreeze() -> None:
    """Frozen objects back into the collector's oldest generation (a process that starts a server again: tests)."""
    gc.unfreeze()
