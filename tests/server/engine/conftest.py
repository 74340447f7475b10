from __future__ import annotations

import pytest
import torch

from linserve.model import LinearGPT
from linserve.server.engine import Engine
from tests.helpers import TINY, assert_slots_balance, engine_config


@pytest.fixture(scope="module")
def tiny_model(device) -> LinearGPT:
    torch.manual_seed(0)
    return LinearGPT(TINY).eval().to(device)


@pytest.fixture
def make_engine(tiny_model, hf_tokenizer, device):
    engines = []

    def factory(model: LinearGPT | None = None, decode_dtype: torch.dtype | None = None,
                draft_model: LinearGPT | None = None, **overrides) -> Engine:
        """An engine on `model` (default: the tiny one); after the test its slots must balance."""
        config = engine_config(**overrides)
        stats = []
        engine = Engine(model if model is not None else tiny_model, hf_tokenizer, config, device, stats.append,
                        decode_dtype=decode_dtype, draft_model=draft_model).start()
        engine.test_stats = stats
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if engine.alive:
            assert_slots_balance(engine)
        engine.stop()
