"""The engine: continuous batching over a fixed-slot (S, z) state pool, sessions and sampling.

Names are resolved lazily so that torch-free parts (the scheduler, the types) import without torch.
"""

from importlib import import_module

_EXPORTS = {
    "Engine": ".core", "EngineConfig": ".types", "SessionInfo": ".sessions.records",
    "EngineError": ".types", "EngineRequest": ".types", "FinishReason": ".types", "RequestOutput": ".types",
    "RequestStats": ".types", "PoolStats": ".types", "SamplingParams": ".types", "StepStats": ".types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name], __name__), name)
