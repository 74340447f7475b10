"""The one channel between the engine core process and a frontend: a duplex `multiprocessing` connection (a
socket pair; each message a length-prefixed pickle of a tuple). Nothing else crosses the boundary.

frontend → core
    ("submit", call_id, EngineRequest)           accept a request; its outputs come back in batches
    ("abort", request_id)
    ("call", call_id, name, args, kwargs)        a session command or a question (one of CALLS)
    ("stop",)                                    drain: abort what runs, flush the session store, exit
core → frontend
    ("ready", EngineFacts, GenerationDefaults)   the model is loaded and the engine runs
    ("failed", message)                          it could not start (the message says why); the core exits
    ("batch", events)                            once per engine step (and per batch of commands), in order:
        ("o", RequestOutput)                         every row's output of the step
        ("s", stats)                                 StepStats, PoolStats (when changed), RequestStats, StoreStats…
        ("r", call_id, ok, value)                    a call's answer: its result, or the EngineError it raised
    ("dead", message)                            the engine died (its requests' error outputs came first)
    ("stopped",)                                 after "stop": everything flushed; the core exits

A step's outputs for all its rows travel as one message: one pickle and one write per step, not per token.
"""

from __future__ import annotations

from ..engine.types import EngineError

# what a frontend may call: the session commands, and the questions /ready, /version and the tests ask
SESSION_CALLS = frozenset({"create", "info", "fork", "kept_result", "forget", "export", "import_", "turns", "rewind",
                           "delete", "keyed_result", "keep_keyed_result", "list"})
ENGINE_CALLS = frozenset({"counts", "slot_accounting", "store_status", "describe_speculation", "describe_decode_step"})
CALLS = frozenset({*(f"sessions.{name}" for name in SESSION_CALLS), *ENGINE_CALLS})
ANSWERED_AT_ONCE = frozenset({"store_status", "describe_speculation", "describe_decode_step"})  # not queued


def crossing(error: BaseException) -> BaseException:
    """An exception as it can cross: EngineError (every subclass) pickles whole; anything else becomes a
    RuntimeError naming it (the frontend answers it as the in-process server would: a 500)."""
    if isinstance(error, EngineError):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
