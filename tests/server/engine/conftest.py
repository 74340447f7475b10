from __future__ import annotations

import queue

import pytest
import torch

from model import LinearGPT, ModelConfig
from server.engine import Engine, EngineConfig, EngineRequest, RequestOutput, SamplingParams

TINY = ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, conv_kernel=3, decay=True, chunk_size=16)


@pytest.fixture(scope="module")
def tiny_model(device) -> LinearGPT:
    torch.manual_seed(0)
    return LinearGPT(TINY).eval().to(device)


class Collector:
    """A thread-safe sink that gathers one request's outputs."""

    def __init__(self) -> None:
        self.queue: queue.Queue[RequestOutput] = queue.Queue()

    def __call__(self, output: RequestOutput) -> None:
        self.queue.put(output)

    def wait(self, rows: int = 1, timeout: float = 60.0) -> list[RequestOutput]:
        outputs, finished = [], 0
        while finished < rows:
            output = self.queue.get(timeout=timeout)
            outputs.append(output)
            finished += output.finished
        return outputs


def tokens_of(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [o.token_id for o in outputs if o.index == index and o.token_id is not None]


def run(engine: Engine, prompt: list[int], params: SamplingParams, request_id: str, session_id=None, owner=None):
    sink = Collector()
    engine.submit(EngineRequest(request_id, prompt, params, session_id=session_id, owner=owner), sink).result(10)
    return sink.wait(params.n)


def assert_slots_balance(engine: Engine) -> dict:
    """Design invariant 5, taken on the engine thread: slots in use == running rows + device-tier sessions,
    no slot held twice or free twice, pool bytes == slots × state bytes."""
    a = engine.slot_accounting().result(10)
    assert a["slots_in_use"] == a["running_rows"] + a["device_sessions"], a
    assert a["distinct_session_slots"] == a["device_sessions"] and a["distinct_row_slots"] == a["row_slots"], a
    assert a["distinct_free"] == a["free_list"] == a["num_slots"] - a["slots_in_use"], a
    assert a["bytes_in_use"] == a["slots_in_use"] * a["slot_bytes"], a
    return a


@pytest.fixture
def make_engine(tiny_model, hf_tokenizer, device):
    engines = []

    def factory(**overrides) -> Engine:
        config = EngineConfig(**{"num_slots": 24, "max_prefill_chunk": 16, "max_batch_tokens": 64, **overrides})
        stats = []
        engine = Engine(tiny_model, hf_tokenizer, config, device, stats.append).start()
        engine.test_stats = stats
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if engine.alive:
            assert_slots_balance(engine)
        engine.stop()
