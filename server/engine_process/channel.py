"""The one channel between the engine core process and a frontend: a duplex `multiprocessing` connection (a
socket pair; each message a length-prefixed pickle of a tuple). Nothing else crosses the boundary. With
`api_servers` N > 1 the core holds N of them, one per frontend process, and reads whichever has a message.

frontend → core
    ("submit", call_id, EngineRequest)           accept a request; its outputs come back in batches
    ("abort", request_id)
    ("call", call_id, name, args, kwargs)        a session command or a question (one of CALLS)
    ("counted", endpoint, status)                an HTTP request answered (N > 1: told to every frontend)
    ("stop",)                                    drain: abort what runs, flush the session store, exit
                                                 (N > 1: this frontend's requests now, the rest once all stop)
core → frontend
    ("ready", EngineFacts, GenerationDefaults)   the model is loaded and the engine runs
    ("failed", message)                          it could not start (the message says why); the core exits
    ("batch", events)                            once per engine step (and per batch of commands), in order:
        ("o", fields)                                every row's output of the step: RequestOutput's fields in order
        ("t", fields)                                the step's StepStats, its fields in order
        ("p", fields)                                PoolStats when it changed, its fields in order
        ("s", stats)                                 RequestStats, StoreStats… (stats go to every frontend: each
                                                     one's /metrics shows the engine)
        ("c", endpoint, status)                      a request some frontend counted (its requests_total)
        ("r", call_id, ok, value)                    a call's answer: its result, or the EngineError it raised
    ("dead", message)                            the engine died (its requests' error outputs came first)
    ("stopped",)                                 after "stop": everything flushed; the core exits

A step's outputs for all its rows travel as one message: one pickle and one write per step, not per token.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection

from ..engine.types import EngineError

# what a frontend may call: the session commands, and the questions /ready, /version and the tests ask
SESSION_CALLS = frozenset({"create", "info", "fork", "kept_result", "forget", "export", "import_", "turns", "rewind",
                           "delete", "abandon", "keyed_result", "keep_keyed_result", "list"})
ENGINE_CALLS = frozenset({"counts", "slot_accounting", "store_status", "describe_speculation", "describe_decode_step",
                          "sync"})
CALLS = frozenset({*(f"sessions.{name}" for name in SESSION_CALLS), *ENGINE_CALLS})
# not queued behind the engine (`sync`: answered once what the frontend sent before it is handled — a scrape asks
# it first, so the requests it counted are in its /metrics)
ANSWERED_AT_ONCE = frozenset({"store_status", "describe_speculation", "describe_decode_step", "sync"})


def encode(message: tuple) -> bytes:
    """A message's bytes: C `pickle` (`conn.send`'s `ForkingPickler` copies its reducer table for every message —
    2 µs a step — and nothing that crosses needs those reducers)."""
    return pickle.dumps(message, pickle.HIGHEST_PROTOCOL)


def send(conn: Connection, message: tuple) -> None:
    """One message, as `conn.recv` reads it."""
    conn.send_bytes(encode(message))


def crossing(error: BaseException) -> BaseException:
    """An exception as it can cross: EngineError (every subclass) pickles whole; anything else becomes a
    RuntimeError naming it (the frontend answers it as the in-process server would: a 500)."""
    if isinstance(error, EngineError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
