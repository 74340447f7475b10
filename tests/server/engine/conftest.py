from __future__ import annotations

import pytest
import torch

from linserve.model import LinearGPT
from linserve.server.engine import Engine
from tests.helpers import TINY, assert_slots_balance, engine_config

DEFAULT_DTYPE = object()  # make_engine's default: the default configuration's dtype


@pytest.fixture(scope="module")
def tiny_model(device) -> LinearGPT:
    torch.manual_seed(0)
    return LinearGPT(TINY).eval().to(device)


@pytest.fixture
def make_engine(tiny_model, hf_tokenizer, device):
    engines = []

    def factory(model: LinearGPT | None = None, dtype: torch.dtype | None = DEFAULT_DTYPE,
                draft_model: LinearGPT | None = None, **overrides) -> Engine:
        """An engine on `model` (default: the tiny one) in the default configuration's dtype — bf16 on a CPU,
        where `dtype auto` picks it on bf16 hardware and the suite forces it elsewhere (None: the model's own);
        after the test its slots must balance."""
        model = model if model is not None else tiny_model
        if dtype is DEFAULT_DTYPE:  # (the softmax baseline keeps its own: its KV cache is sized in it)
            dtype = torch.bfloat16 if device.type == "cpu" and model.config.attention == "linear" else None
        config = engine_config(**overrides)
        stats = []
        engine = Engine(model, hf_tokenizer, config, device, stats.append,
                        dtype=dtype, draft_model=draft_model).start()
        engine.test_stats = stats
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if engine.alive:
            assert_slots_balance(engine)
        engine.stop()
