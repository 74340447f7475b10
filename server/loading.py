"""Loading what a server serves: the checkpoint (any family), its tokenizer and generation defaults, the
draft model, the engine sized from the settings. Used alike by the in-process engine (app.py's lifespan), the
engine core process (engine_process/core_main.py) and `linserve compile`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from linserve.model import projection
from linserve.model.checkpoint import load_served, load_tokenizer
from linserve.model.interface import fixed_state
from linserve.model.loading import DEFAULT_CHECKPOINT, load_model, resolve_device, resolve_dtype
from linserve.model.vocabulary import checkpoint_vocab_size, serve_tokenizer_vocabulary
from linserve.model.weights import keep_one_copy

from .engine import Engine, EngineConfig, heap
from .engine.state_pool import slots_for_budget
from .generation_defaults import GenerationDefaults
from .settings import Settings

logger = logging.getLogger("linserve.server.app")  # (its lines read as they did when this lived in app.py)


def engine_config(settings: Settings, model) -> EngineConfig:
    """Slots from the settings: a count, or a memory budget ÷ bytes per slot (a KV cache's at max_context)."""
    linear = fixed_state(model)
    slot_bytes = model.state_bytes() if linear else model.state_bytes(settings.max_context)
    slots = settings.num_slots
    budget_mb = settings.state_memory_mb if linear else (settings.state_memory_mb or settings.kv_memory_mb)
    if budget_mb is not None:
        budget_slots = slots_for_budget(int(budget_mb * 2**20), slot_bytes)
        if budget_slots < 1:
            raise ValueError(f"a memory budget of {budget_mb} MB holds no slot of {slot_bytes} bytes")
        slots = budget_slots if linear else min(slots, budget_slots)
    return EngineConfig.from_settings(settings, num_slots=slots)


def load_draft(settings: Settings, model, tokenizer, device):
    """The draft model (fp32) for `speculative: draft`: `draft_model`, or None when unset (none is shipped: on a
    CPU the shipped model is too small for a draft model to pay). It must share the served model's tokenizer."""
    draft_path = Path(settings.draft_model) if settings.draft_model else None
    if draft_path is None or not fixed_state(model):
        if settings.speculative == "draft":
            raise ValueError("speculative: draft needs a draft model (--draft-model) for a linear-attention model")
        return None
    import torch

    draft = load_model(draft_path, device, torch.float32).model
    if draft.config.vocab_size > model.config.vocab_size:  # (the served model's padding is cut: the draft's too)
        serve_tokenizer_vocabulary(draft, model.config.vocab_size)
    if not fixed_state(draft) or draft.config.vocab_size != model.config.vocab_size or (
            load_tokenizer(draft_path).get_vocab() != tokenizer.get_vocab()):
        raise ValueError(f"the draft model {draft_path} must be a linear-attention model with the served model's "
                         "tokenizer (the same vocabulary and ids)")
    logger.info("draft model %s: %.2f M parameters, %d state bytes per slot", draft_path,
                draft.num_parameters() / 1e6, draft.state_bytes())
    return draft


def load_engine(settings: Settings, stats_sink) -> tuple[Engine, object, GenerationDefaults]:
    """The model, its tokenizer and generation defaults, and the started engine reporting to `stats_sink`."""
    started = time.perf_counter()
    path = Path(settings.model) if settings.model else DEFAULT_CHECKPOINT
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)  # every form's: prefill, decode steps and verification
    projection.use_quantization(settings.quantization, device, dtype)
    # any served family, strictly (model/checkpoint.py); a vocabulary padded past the tokenizer served as its
    model, tokenizer = load_served(path, device, dtype)
    if not fixed_state(model):  # the softmax baseline stays fp32: its KV cache is sized in it
        model = model.float()
        dtype = next(model.parameters()).dtype
    if checkpoint_vocab_size(model) != model.config.vocab_size:
        logger.info("vocab_size %d is padded past the tokenizer's %d tokens: ids %d.. have no token and are never "
                    "served", checkpoint_vocab_size(model), len(tokenizer), len(tokenizer))
    config = engine_config(settings, model)
    generation = (GenerationDefaults.read(path, model.config.vocab_size) if settings.generation_config == "auto"
                  else GenerationDefaults())
    if generation.source:
        logger.info("%s: end-of-text ids %s, request defaults %s", generation.source,
                    sorted({*generation.eos_token_ids, tokenizer.eos_token_id} - {None}),
                    {**generation.sampling, **({"max_tokens": generation.max_tokens} if generation.max_tokens else {})})
    freed = keep_one_copy(model)  # the projections' packed weights are the only copy from here on
    if freed:
        logger.info("projection weights packed for the kernel: their originals released (%.0f MB)", freed / 2**20)
        heap.trim()  # glibc keeps freed heap (the originals, packing's scratch) unless asked to give it back
    draft = load_draft(settings, model, tokenizer, device)
    engine = Engine(model, tokenizer, config, device, stats_sink, draft_model=draft,
                    eos_token_ids=generation.eos_token_ids, checkpoint=str(path)).start()
    plan = engine.threads
    weights = str(dtype).removeprefix("torch.") + (" (auto)" if settings.dtype == "auto" else "") + (
        ", int8 projections" if settings.quantization == "int8" else "")
    logger.info("loaded %s on %s in %.1f s (%s weights; %d intra-op CPU threads, %d in compiled programs' kernels, "
                "%d for prefill, %s%s: %g CPUs usable, OMP_WAIT_POLICY %s): %d slots x %d state bytes", path, device,
                time.perf_counter() - started, weights, plan.threads, plan.kernel_threads, plan.prefill_threads,
                plan.source,
                ", fewer while other processes hold the CPUs" if plan.adaptive else "", plan.usable_cpus,
                plan.omp_wait_policy, config.num_slots, engine.pool.slot_bytes)
    return engine, tokenizer, generation
