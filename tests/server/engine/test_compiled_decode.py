"""The compiled decode step (buckets, padding, CUDA graphs on CUDA) computes what the eager one does."""

import threading
from pathlib import Path

import pytest
import torch

from model import LinearGPT
from model.loading import DEFAULT_CHECKPOINT, load_model
from server.engine.compiled_decode import DecodeStep, bucket_sizes
from server.engine.state_pool import StatePool
from tests.helpers import TINY, Collector, EngineRequest, SamplingParams, assert_slots_balance, run, tokens_of

pytestmark = pytest.mark.slow  # each test compiles (seconds to a minute on 2 cores)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compile_cache"))


def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 32, 64]


def test_every_bucket_and_padded_batch_matches_eager(tiny_model, device, compile_cache):
    pool = StatePool(tiny_model, 8, device)
    for buffer in pool.buffers.values():
        buffer.normal_()  # every slot holds some history
    compiled = DecodeStep(tiny_model, pool, device, "on", max_rows=4, cache_dir=compile_cache)
    eager = DecodeStep(tiny_model, pool, device, "off", max_rows=4)
    compiled.sizes = [1, 4]  # two of its buckets (each compile takes ~30 s on 2 cores): 2 and 3 rows pad to 4
    compiled.start()
    assert compiled.wait_compiled(300) and compiled.status == "compiled", compiled.status
    assert compiled.ready_sizes == [1, 4]
    with torch.inference_mode():
        for slots in ([5], [2, 7], [0, 3, 6], [1, 2, 3, 4], [4, 1, 0, 2, 7]):  # 2, 3 pad to 4; 5 is beyond: eager
            tokens = [(11 * s + 3) % 1024 for s in slots]
            logits, state = compiled(tokens, slots)
            want_logits, want_state = eager(tokens, slots)
            assert logits.shape == (len(slots), 1024) and logits.dtype == torch.float32
            torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
            for name, tensor in state.tensors().items():
                assert tensor.shape[0] == len(slots)
                torch.testing.assert_close(tensor, want_state.tensors()[name], rtol=1e-5, atol=1e-5)
    assert any(path.is_file() for path in Path(compile_cache).rglob("*"))  # Inductor's cache is on disk

    torch.manual_seed(7)  # same shapes, other weights: the compiled code must not carry the first model's
    other = LinearGPT(TINY).eval().to(device)
    other_pool = StatePool(other, 2, device)
    other_step = DecodeStep(other, other_pool, device, "on", max_rows=1, cache_dir=compile_cache)
    other_step.start()
    assert other_step.wait_compiled(300)
    with torch.inference_mode():
        got, want = other_step([9], [1])[0], DecodeStep(other, other_pool, device, "off")([9], [1])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_engine_serves_eagerly_while_compiling_then_the_same_tokens_compiled(make_engine, compile_cache, monkeypatch):
    compiling = threading.Event()  # the compiler waits for it: the first request surely meets no bucket
    original = DecodeStep._compiler

    def held_compiler(self):
        compiling.wait(60)
        return original(self)

    monkeypatch.setattr(DecodeStep, "_compiler", held_compiler)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 1], [300, 2, 44, 8], [17]]
    eager = make_engine(num_slots=4)
    want = [tokens_of(run(eager, p, greedy, f"e{i}")) for i, p in enumerate(prompts)]

    engine = make_engine(num_slots=4, compile="on", compile_cache_dir=compile_cache)
    assert tokens_of(run(engine, prompts[0], greedy, "early")) == want[0]
    assert engine.decode_step.status == "compiling" and engine.decode_step.ready_sizes == []  # served eagerly
    compiling.set()
    assert engine.decode_step.wait_compiled(300), engine.decode_step.status
    for i, prompt in enumerate(prompts):  # one at a time: bucket 1
        assert tokens_of(run(engine, prompt, greedy, f"c{i}")) == want[i]
    sinks = [Collector() for _ in prompts]  # together: 4 rows, then 3 (padded to 4), 2, 1 as they finish
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        params = SamplingParams(max_tokens=24 - 4 * i, temperature=0.0, ignore_eos=True)
        engine.submit(EngineRequest(f"b{i}", prompt, params), sink).result(10)
    for i, sink in enumerate(sinks):
        assert tokens_of(sink.wait()) == want[i][: 24 - 4 * i]
    assert_slots_balance(engine)


def test_a_failed_compile_leaves_the_engine_serving_eagerly(make_engine, monkeypatch):
    def broken(self):
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(DecodeStep, "_compiler", broken)
    engine = make_engine(num_slots=4, compile="on")
    engine.decode_step.wait_compiled(30)
    assert engine.decode_step.status == "failed" and engine.decode_step.ready_sizes == []
    outputs = run(engine, [5, 6], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), "after")
    assert len(tokens_of(outputs)) == 5 and outputs[-1].finish_reason.value == "length"
    assert engine.alive


def decode_through(step: DecodeStep, model, prompt: list[int], count: int, forced: list[int] | None = None):
    """Decode `count` tokens through `step` from one pool slot: greedy, or feeding `forced` tokens (teacher
    forcing). Returns the argmax of every step and the logits (count, V)."""
    device = model.wte.weight.device
    with torch.inference_mode():
        logits, state = model(torch.tensor([prompt], device=device))
        step.pool.scatter([0], state)
        token, chosen, all_logits = int(logits[0, -1].float().argmax()), [], []
        for i in range(count):
            token = forced[i] if forced is not None else token
            chosen.append(token)
            logits, state = step([token], [0])
            step.pool.scatter([0], state)
            all_logits.append(logits[0].clone())
            token = int(logits[0].argmax())
    return chosen, torch.stack(all_logits)


def test_shipped_model_compiled_and_bf16_over_512_tokens(device, compile_cache):
    """fp32 compiled == fp32 eager, token for token over 512 greedy tokens, logits within 1e-4.

    bf16 weights (state fp32), eager and compiled, fed fp32's 512 tokens: logits within 0.3 of fp32's and
    the same top-1 token at ≥ 97% of positions. (Their own greedy runs follow fp32's until a near tie —
    the 84th token with the shipped model — flips; after that the text differs, as with any bf16 model.)"""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(DEFAULT_CHECKPOINT)).encode("ROMEO:\nBut soft, what light")
    steps = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(DEFAULT_CHECKPOINT, device, dtype).model
        for mode in ("off", "on"):
            step = DecodeStep(model, StatePool(model, 2, device), device, mode, max_rows=1, cache_dir=compile_cache)
            step.start()
            assert step.wait_compiled(600) or mode == "off", step.status
            steps[dtype, mode] = step, model
    fp32_tokens, fp32_logits = decode_through(*steps[torch.float32, "off"], prompt, 512)
    compiled_tokens, compiled_logits = decode_through(*steps[torch.float32, "on"], prompt, 512)
    assert compiled_tokens == fp32_tokens
    torch.testing.assert_close(compiled_logits, fp32_logits, rtol=0, atol=1e-4)
    for mode in ("off", "on"):
        greedy, _ = decode_through(*steps[torch.bfloat16, mode], prompt, 64)
        assert greedy == fp32_tokens[:64], mode
        _, logits = decode_through(*steps[torch.bfloat16, mode], prompt, 512, forced=fp32_tokens)
        assert (logits - fp32_logits).abs().max() < 0.3, mode
        assert (logits.argmax(-1) == fp32_logits.argmax(-1)).float().mean() >= 0.97, mode


def test_auto_on_a_cpu_without_a_cpp_compiler_declines_at_once(tiny_model, monkeypatch):
    """A slim container image has no g++: `compile=auto` serves eagerly instead of failing in Inductor."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    cpu = torch.device("cpu")
    step = DecodeStep(tiny_model, StatePool(tiny_model, 2, cpu), cpu, "auto", max_rows=2)
    step.start()
    assert step.wait_compiled(10) is False and step.status == "declined" and step.ready_sizes == []


class _Traced(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x).relu()


def test_compile_time_tracing_never_reaches_the_engines_eager_calls(make_engine):
    """torch.fx's Tracer.trace patches nn.Module.__call__ for the whole process while it traces (the
    background compile traces through make_fx): without the guard, the engine's eager model calls meanwhile
    go through the tracer and fail ('module is not installed as a submodule'), three in a row kill the
    engine. With it (installed by DecodeStep.start), traces and engine steps never overlap."""
    from server.engine.compiled_decode import guard_tracing
    from server.engine.types import FinishReason

    guard_tracing()
    engine = make_engine(num_slots=8)
    stop = threading.Event()

    def trace_continuously() -> None:
        while not stop.is_set():
            torch.fx.symbolic_trace(_Traced())

    tracer = threading.Thread(target=trace_continuously, daemon=True)
    tracer.start()
    try:
        for i in range(30):
            outputs = run(engine, list(range(1, 41)), SamplingParams(max_tokens=8, temperature=0), f"r{i}")
            assert outputs[-1].finish_reason is not FinishReason.ERROR, outputs[-1].error
    finally:
        stop.set()
        tracer.join(10)
    assert engine.alive


def test_the_compile_cache_is_per_user_and_keyed_by_model_dtype_torch_and_device(tiny_model, monkeypatch, tmp_path):
    import copy

    from server.engine.compiled_decode import compile_cache_dir

    cpu = torch.device("cpu")
    model = copy.deepcopy(tiny_model).cpu()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = compile_cache_dir(None, model, cpu)
    assert default.startswith(str(tmp_path / "xdg" / "linserve" / "compile"))  # not the working directory
    assert compile_cache_dir(None, model, cpu) == default  # stable: a restart finds it
    assert torch.__version__.replace("/", "_") in default and "float32" in default
    assert compile_cache_dir(None, LinearGPT(model.config), cpu) != default  # other weights (they are compiled in)
    assert compile_cache_dir(None, copy.deepcopy(model).to(torch.bfloat16), cpu) != default
    assert compile_cache_dir(str(tmp_path / "mine"), model, cpu).startswith(str(tmp_path / "mine"))
    assert DecodeStep(model, StatePool(model, 1, cpu), cpu, "off").cache_dir is None
