"""What differs between a model with a fixed-size state (every linear-attention family) and the softmax baseline
with its KV cache — chosen once, here, so the engine core uses the parts and never asks which kind it has.

A fixed-size state brings the state pool, the decode program (compiled in the background), speculative decoding,
the prefix cache, the session store, turn texts and preemption. The baseline brings its KV-cache pool and its
runner (softmax_baseline.py), a context limit per request, and none of the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from linserve.model.interface import fixed_state

from .compile.compiled_decode import DecodeStep
from .prefill_program import PREFILL_ROWS, PrefillKind, fits, prefill_kind
from .prefix_cache import PrefixCache
from .sampling import SlotSampling
from .sessions.backends import open_store
from .sessions.stores import NoStore, SessionStore
from .softmax_baseline import KVCachePool, KVCacheRunner, check_context
from .spec.speculation import SpeculationPolicy, SpeculativeDecoding
from .state_pool import SlotPool, StatePool, states_within
from .step_runner import StepRunner
from .types import EngineConfig, SamplingParams


@dataclass
class ModelParts:
    pool: SlotPool
    runner: StepRunner
    prefix_cache: PrefixCache
    store: SessionStore  # NoStore: sessions live in this process only (`none`, and every softmax model)
    text_chars: int  # each session's turn text kept (0: none)
    preemptible: bool  # a running request's state can be parked and brought back (priority scheduling)
    decode_step: DecodeStep | None = None  # the decode program (None: the baseline's runner decodes)
    prefill_step: DecodeStep | None = None  # short prompt chunks as one program (prefill_program.py), if any
    speculative: SpeculativeDecoding | None = None
    check_context: Callable[[int, int], None] = lambda feed, max_tokens: None  # (prompt, max_tokens) → may raise

    @property
    def speculation(self) -> SpeculationPolicy | None:
        return self.speculative.policy if self.speculative is not None else None

    def start(self, speculative_default: str) -> None:
        if self.decode_step is not None:
            self.decode_step.start()  # compiles in the background; eager serves meanwhile
            self.speculative.start(speculative_default)  # (after the decode step's buckets)
        if self.prefill_step is not None:
            self.prefill_step.start()  # (after the decode step's buckets, as it decided)

    def close(self) -> None:
        if self.decode_step is not None:
            self.decode_step.close()
            self.speculative.close()
        if self.prefill_step is not None:
            self.prefill_step.close()

    def admit(self, params: SamplingParams) -> None:
        """What this kind checks of a request's sampling before it queues (a draft model it lacks: 400)."""
        if self.speculative is not None:
            self.speculative.admit(params)

    def describe_speculation(self) -> dict | None:
        return self.speculative.describe() if self.speculative is not None else None


def served_prefill_kind(model, tokens: int, device: torch.device) -> PrefillKind | None:
    """The prefill program a server of this model compiles (`serve` and `linserve compile` alike): CPU only, and
    only where `tokens` prefixes of the largest bucket's rows fit the budget; None: prefill stays eager."""
    if device.type == "cpu" and tokens and fits(model, tokens, PREFILL_ROWS):
        return prefill_kind(tokens)
    return None


def model_parts(model, config: EngineConfig, sampling: SlotSampling, device: torch.device, eos_ids: frozenset[int],
                threads, draft_model=None) -> ModelParts:
    max_rows = min(config.num_slots, config.max_batch_tokens)
    if not fixed_state(model):
        pool = KVCachePool(model, config.num_slots, config.max_context, device)
        prefix_cache = PrefixCache(0, config.max_prefill_chunk, pool.slot_bytes)
        runner = KVCacheRunner(model, pool, sampling, None, prefix_cache, device, eos_ids, threads)
        return ModelParts(pool, runner, prefix_cache, store=NoStore(), text_chars=0, preemptible=False,
                          check_context=lambda feed, max_tokens: check_context(feed, max_tokens, config.max_context))
    pool = StatePool(model, config.num_slots, device)
    decode_step = DecodeStep(model, pool, sampling, device, config.compile, max_rows, config.compile_cache_dir,
                             config.compile_autotune, cache_max_gb=config.compile_cache_max_gb)
    speculative = SpeculativeDecoding(model, pool, sampling, device, config, max_rows, decode_step, eos_ids,
                                      draft_model)
    prefill_step = None
    prefill = served_prefill_kind(model, config.prefill_program_tokens, device)
    if config.compile != "off" and prefill is not None:
        prefill_step = DecodeStep(model, pool, sampling, device, config.compile, min(PREFILL_ROWS, config.num_slots),
                                  config.compile_cache_dir, config.compile_autotune, kind=prefill, after=decode_step)
    entries = states_within(config.prefix_cache_entries, config.prefix_cache_mb, pool.slot_bytes)
    prefix_cache = PrefixCache(entries, config.max_prefill_chunk, pool.slot_bytes)
    runner = StepRunner(model, pool, sampling, decode_step, prefix_cache, device, eos_ids, threads,
                        speculative.verify_steps, speculative.policy, prefill_step)
    store = open_store(config.session_store, config.session_ttl_s, config.session_store_timeout_s)
    return ModelParts(pool, runner, prefix_cache, store, config.session_text_chars, preemptible=True,
                      decode_step=decode_step, speculative=speculative, prefill_step=prefill_step)
