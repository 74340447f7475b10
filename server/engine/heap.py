"""Giving freed heap back to the OS after a very large request.

glibc keeps freed memory in its arenas (and raises its mmap threshold after large frees), so one
multi-megabyte prompt — hundreds of MB while it is tokenized, tens of MB of token lists while it is
prefilled — would stay in the process's RSS for good. `trim()` asks glibc to return it; elsewhere it
does nothing. Called only after requests past `LARGE_TOKENS`, so its few milliseconds are rare.
"""

from __future__ import annotations

import ctypes

LARGE_TOKENS = 1 << 16
LARGE_TEXT_CHARS = 1 << 20

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None


def trim() -> None:
    if _malloc_trim is not None:
        _malloc_trim(0)
