"""The engine's checks and counts that need no engine state of their own: what a request may ask of this
engine (400 / 429 before it queues), the pool's occupancy for the metrics, and the slot accounting every
engine test asserts (design invariant 5: slots in use == running rows + device-tier sessions)."""

from __future__ import annotations

from .types import EngineError, EngineRequest, PoolStats


def check_request(request: EngineRequest, config, reserved_slots: int, vocab_size: int) -> None:
    """What the request's parameters ask of this engine: n, top_k, token ids, logit_bias — the one check of
    these for HTTP and in-process callers alike (the HTTP side checks the settings' limits: api/common/limits.py)."""
    params = request.params
    if params.n > config.max_n:
        raise EngineError(f"n must be <= {config.max_n}", param="n")
    if params.n > reserved_slots:
        raise EngineError(f"n must be <= {reserved_slots} on this server (state slots)", param="n")
    if params.top_k > vocab_size:
        raise EngineError(f"top_k must be <= the vocabulary size {vocab_size} (0 disables it)", param="top_k")
    check_token_ids(request.prompt_ids, vocab_size)
    outside = next((t for t, _ in params.logit_bias if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise EngineError(f"logit_bias names token id {outside}, outside the vocabulary (0..{vocab_size - 1})",
                          param="logit_bias")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """A prompt's token ids are in the vocabulary — the tokenizer's ids: a checkpoint's padding past it is not
    served (model/vocabulary.py) — (the one check: every request, and a session created with a prompt before it
    exists). The message names the first id outside."""
    outside = next((t for t in ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise EngineError(f"prompt token ids must be in [0, {vocab_size}): {outside} is not", param="prompt")


def pool_stats(pool, registry, scheduler) -> PoolStats:
    tiers = registry.tiers.counts()
    return PoolStats(running=scheduler.num_running, waiting=scheduler.num_waiting, slots_in_use=pool.used_slots,
                     slots_total=pool.num_slots, state_bytes_in_use=pool.bytes_in_use,
                     sessions_device=tiers["device"], sessions_host=tiers["host"], sessions_store=registry.stored)


def slot_accounting(pool, registry, scheduler, live: dict) -> dict[str, int]:
    """Who holds which slot (taken on the engine thread)."""
    session_slots = [s.slot for s in registry.by_id.values() if s.slot is not None]
    seq_slots = [slot for seq in scheduler.active.values() for slot in seq.slots]
    row_only = set(seq_slots) - set(session_slots)
    return {
        "slots_in_use": pool.used_slots,
        "running_rows": len(row_only),
        "device_sessions": len(session_slots),
        "counted_device_sessions": registry.tiers.counts()["device"],  # what the gauges report (tiers.on_device)
        "distinct_session_slots": len(set(session_slots)),
        "distinct_row_slots": len(set(seq_slots)),
        "row_slots": len(seq_slots),
        "free_list": pool.free_slots,
        "distinct_free": pool.distinct_free_slots,
        "num_slots": pool.num_slots,
        "bytes_in_use": pool.bytes_in_use,
        "slot_bytes": pool.slot_bytes,
        "live": len(live),
    }
