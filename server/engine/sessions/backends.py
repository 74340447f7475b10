"""The session store a `session_store` setting names: `none`, `dir:PATH` or `redis://HOST:PORT/DB`."""

from __future__ import annotations

from .dir_store import DirStore
from .stores import NoStore, SessionStore


def open_store(spec: str, ttl_s: float = 3600.0, timeout_s: float = 2.0) -> SessionStore:
    """`none`, `dir:PATH` or `redis://HOST:PORT/DB`."""
    if spec == "none":
        return NoStore()
    if spec.startswith("dir:") and len(spec) > 4:
        return DirStore(spec[4:])
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from .redis_store import RedisStore  # needs the redis client: imported only for this store

        return RedisStore(spec, ttl_s, timeout_s)
    raise ValueError(f"session_store must be 'none', 'dir:PATH' or 'redis://HOST:PORT/DB', got {spec!r}")
