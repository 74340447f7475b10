"""`redis://HOST:PORT/DB` — the session store that several replicas share.

One key per session (expiring `ttl_s` after its last write), a revision key beside it, a hash of the session's
entries (stored responses; expiring and removed with the record; `#bytes` their total), a sorted set of ids
per owner, a lease key per session while a replica changes it, and a key per keyed result. Every write is one
Lua script: atomic, and conditional on the deadline by Redis' own clock (`TIME`), so a write that reaches a
Redis frozen with SIGSTOP and runs once it wakes, after its caller was told it failed, changes nothing. Every call has a
socket timeout: a hung Redis costs its caller at most that long, never the engine thread (only the store
worker calls this).
"""

from __future__ import annotations

import redis

from .stores import ENTRY_NAME, SESSION_ID, OutcomeUnknown, StoreTimeout, header_metadata, owner_key

# `late` is 1 when Redis' clock has passed ARGV[1] (the caller's deadline, unix ms)
_LATE = ("if redis.replicate_commands then redis.replicate_commands() end "
         "local now = redis.call('TIME') "
         "local late = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[1]) ")
# KEYS record, revision, owner index, entries; ARGV deadline, data, revision, ttl ms, session id
_PUT = _LATE + """if late then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
redis.call('PEXPIRE', KEYS[4], ARGV[4])
redis.call('ZADD', KEYS[3], 0, ARGV[5])
redis.call('PEXPIRE', KEYS[3], ARGV[4], 'NX')
redis.call('PEXPIRE', KEYS[3], ARGV[4], 'GT')
return 1"""
# the index lives as long as its longest-lived record: set on a new index, else only ever extended
# KEYS record, revision, owner index, entries; ARGV deadline, session id
_DELETE = _LATE + """if late then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[4])
redis.call('ZREM', KEYS[3], ARGV[2])
return 1"""
# KEYS entries; ARGV deadline, name, data, budget, ttl ms; -1 late, 0 over the budget, 1 written
_PUT_ENTRY = _LATE + """if late then return -1 end
local total = tonumber(redis.call('HGET', KEYS[1], '#bytes') or '0')
total = total - redis.call('HSTRLEN', KEYS[1], ARGV[2]) + string.len(ARGV[3])
if total > tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3], '#bytes', total)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1"""
# KEYS entries; ARGV deadline, name
_DELETE_ENTRY = _LATE + """if late then return 0 end
local size = redis.call('HSTRLEN', KEYS[1], ARGV[2])
if redis.call('HDEL', KEYS[1], ARGV[2]) == 1 then redis.call('HINCRBY', KEYS[1], '#bytes', -size) end
return 1"""
# KEYS lease; ARGV deadline, holder, lease ms
_ACQUIRE = _LATE + """if late then return -1 end
if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then return 1 end
return 0"""
# the same, run even while Redis is at `maxmemory` (Redis >= 7: a script's shebang flags): a lease key is a few
# bytes, and without it a full store could not be emptied — a delete takes the session's lease first
_ACQUIRE_ALLOW_OOM = "#!lua flags=allow-oom\n" + _ACQUIRE
# compare-and-act on a lease: only its holder may renew or release it
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
FAR_FUTURE_MS = 2**62  # no deadline


def _ms(deadline: float | None) -> int:
    return FAR_FUTURE_MS if deadline is None else int(deadline * 1000)


def _write(script, keys: list, args: list):
    """Run a write script. Not connecting is a plain failure (nothing was sent); a timeout or a connection lost
    once connected may come after Redis ran it: OutcomeUnknown."""
    try:
        return script(keys=keys, args=args)
    except redis.exceptions.TimeoutError as error:
        raise OutcomeUnknown(f"Redis did not answer the write in time ({error})") from error
    except redis.exceptions.ConnectionError as error:
        if "connecting to" in str(error) or "Connection refused" in str(error):
            raise
        raise OutcomeUnknown(f"the connection to Redis was lost during the write ({error})") from error


class RedisStore:
    PREFIX = "linserve:session:"
    REVISION = "linserve:revision:"
    LEASE = "linserve:lease:"
    OWNER = "linserve:owner:"  # a sorted set of session ids per owner (score 0: ordered by id)
    ENTRIES = "linserve:entries:"  # a hash per session: entry name → bytes, and "#bytes"
    KEY = "linserve:key:"  # a keyed result
    shared, keeps = True, True
    kind = "redis"

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 2.0) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self._put, self._delete, self._acquire, self._renew, self._release, self._put_entry, self._delete_entry = (
            self.client.register_script(s) for s in (_PUT, _DELETE, _ACQUIRE, _RENEW, _RELEASE, _PUT_ENTRY,
                                                      _DELETE_ENTRY))
        self._acquire_any = None  # chosen by the server's version at the first lease

    def _key(self, session_id: str, prefix: str = PREFIX) -> str | None:
        return prefix + session_id if SESSION_ID.fullmatch(session_id) else None

    def put(self, session_id: str, data: bytes, revision: str = "", owner: str = "",
            deadline: float | None = None) -> None:
        key = self._key(session_id)
        if key is None:
            raise ValueError(f"not a session id: {session_id!r}")
        keys = [key, self.REVISION + session_id, self.OWNER + owner_key(owner), self.ENTRIES + session_id]
        if not _write(self._put, keys, [_ms(deadline), data, revision, self.ttl_ms, session_id]):
            raise StoreTimeout("the session store did not finish the write in time")

    def get(self, session_id: str) -> bytes | None:
        key = self._key(session_id)
        return None if key is None else self.client.get(key)

    def revision(self, session_id: str) -> str | None:
        """The revision of the stored record (None: no record)."""
        key = self._key(session_id, self.REVISION)
        value = None if key is None else self.client.get(key)
        return None if value is None else value.decode()

    def delete(self, session_id: str, owner: str | None = None, deadline: float | None = None) -> None:
        key = self._key(session_id)
        if key is None:
            return
        if owner is None:
            owner = (self.metadata(session_id) or {}).get("owner", "")
        keys = [key, self.REVISION + session_id, self.OWNER + owner_key(owner), self.ENTRIES + session_id]
        if not _write(self._delete, keys, [_ms(deadline), session_id]):
            raise StoreTimeout("the session store did not finish the delete in time")

    def _entries(self, session_id: str, name: str) -> str:
        if not (SESSION_ID.fullmatch(session_id) and ENTRY_NAME.fullmatch(name)):
            raise ValueError(f"not a session entry: {session_id!r} / {name!r}")
        return self.ENTRIES + session_id

    def put_entry(self, session_id: str, name: str, data: bytes, budget: int,
                  deadline: float | None = None) -> bool:
        """Its expiry is the session's (each write of the record renews both)."""
        written = _write(self._put_entry, [self._entries(session_id, name)], [_ms(deadline), name, data, budget,
                                                                               self.ttl_ms])
        if written == -1:
            raise StoreTimeout("the session store did not finish the write in time")
        return bool(written)

    def get_entry(self, session_id: str, name: str) -> bytes | None:
        try:
            return self.client.hget(self._entries(session_id, name), name)
        except ValueError:
            return None

    def delete_entry(self, session_id: str, name: str, deadline: float | None = None) -> None:
        if not _write(self._delete_entry, [self._entries(session_id, name)], [_ms(deadline), name]):
            raise StoreTimeout("the session store did not finish the delete in time")

    def put_key(self, name: str, data: bytes, ttl_s: float) -> None:
        if not ENTRY_NAME.fullmatch(name):
            raise ValueError(f"not a key: {name!r}")
        self.client.set(self.KEY + name, data, px=max(int(ttl_s * 1000), 1))

    def get_key(self, name: str) -> bytes | None:
        return self.client.get(self.KEY + name) if ENTRY_NAME.fullmatch(name) else None

    def unindex(self, session_id: str, owner: str) -> None:
        self.client.zrem(self.OWNER + owner_key(owner), session_id)

    def owned(self, owner: str, after: str | None, limit: int, descending: bool) -> list[str]:
        index = self.OWNER + owner_key(owner)
        if descending:
            ids = self.client.zrevrangebylex(index, "+" if after is None else f"({after}", "-", start=0, num=limit)
        else:
            ids = self.client.zrangebylex(index, "-" if after is None else f"({after}", "+", start=0, num=limit)
        return [i.decode() for i in ids if SESSION_ID.fullmatch(i.decode(errors="replace"))]

    def metadata(self, session_id: str) -> dict[str, str] | None:
        key = self._key(session_id)
        if key is None:
            return None
        return header_metadata(lambda start, length: self.client.getrange(key, start, start + length - 1))

    def acquire(self, session_id: str, holder: str, lease_ms: int, deadline: float | None = None) -> bool:
        key = self._key(session_id, self.LEASE)
        if key is None:
            return False
        got = self._lease_script()(keys=[key], args=[_ms(deadline), holder, lease_ms])
        if got == -1:
            raise StoreTimeout("the session store did not grant the lease in time")
        return bool(got)

    def _lease_script(self):
        """The allow-oom acquire where Redis reads script flags (7.0 on), the plain one before."""
        if self._acquire_any is None:
            major = int(str(self.client.info("server").get("redis_version", "0")).split(".")[0])
            self._acquire_any = self.client.register_script(_ACQUIRE_ALLOW_OOM) if major >= 7 else self._acquire
        return self._acquire_any

    def renew(self, session_id: str, holder: str, lease_ms: int) -> bool:
        return bool(self._renew(keys=[self.LEASE + session_id], args=[holder, lease_ms]))

    def release(self, session_id: str, holder: str) -> None:
        self._release(keys=[self.LEASE + session_id], args=[holder])

    def expired(self, ttl_s: float) -> list[str]:
        return []  # Redis expires keys by itself

    def count(self) -> int:
        return sum(1 for _ in self.client.scan_iter(match=self.PREFIX + "*", count=1000))

    def ping(self) -> None:
        self.client.ping()
