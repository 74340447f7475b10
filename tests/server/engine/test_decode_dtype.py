"""Weights in another dtype than the model's (serve's bf16 on a CPU with bf16 in hardware): the engine serves a
copy in that dtype for every form — prefill, decode steps, verification; the (S, z) state stays fp32."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as load_safetensors

from linserve.server.engine import EngineError, SamplingParams
from tests.helpers import GREEDY, prompt, run, tokens_of


def session_state(engine, session_id: str) -> dict[str, torch.Tensor]:
    tensors = load_safetensors(engine.sessions.export(session_id, None).result(10))
    return {name.removeprefix("state."): t for name, t in tensors.items() if name.startswith("state.")}


def test_every_form_runs_the_engines_dtype_and_equals_the_model_bit_for_bit(make_engine, tiny_model, device):
    engine = make_engine(dtype=torch.bfloat16)
    assert next(tiny_model.parameters()).dtype == torch.float32  # untouched: the engine serves a copy
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.decode_step.model is engine.model
    assert {b.dtype for b in engine.pool.buffers.values()} == {torch.float32}

    ids = prompt(40)  # three prefill chunks (max_prefill_chunk 16)
    session = engine.sessions.create(None).result(10)
    run(engine, ids, SamplingParams(max_tokens=0), "p", session_id=session.id)
    state = session_state(engine, session.id)
    with torch.inference_mode():
        logits, reference = engine.model(torch.tensor([ids], device=device))
    for name, tensor in reference.tensors().items():  # the chunks' state is the whole prompt's, to the bit
        assert torch.equal(state[name], tensor[0].cpu()), name

    # generation: the first token from the prompt's logits, then the model's own recurrent steps — exactly
    generated = tokens_of(run(engine, ids, GREEDY, "g"))
    expected, step_logits, step_state = [], logits[0, -1].float(), reference
    with torch.inference_mode():
        for _ in range(GREEDY.max_tokens):
            expected.append(int(step_logits.argmax()))
            out, step_state = engine.model(torch.tensor([[expected[-1]]], device=device), step_state)
            step_logits = out[0, -1].float()
    assert generated == expected


def test_a_snapshot_names_the_decode_weights(make_engine):
    """A state decoded with bf16 weights does not resume, as if exact, where fp32 weights decode."""
    fp32_engine = make_engine(num_slots=4, dtype=None)
    session = fp32_engine.sessions.create(None).result(10)
    run(fp32_engine, prompt(9, 3), GREEDY, "a", session_id=session.id)
    data = fp32_engine.sessions.export(session.id, None).result(10)
    bf16_engine = make_engine(dtype=torch.bfloat16, num_slots=4)
    with pytest.raises(EngineError, match="different model"):
        bf16_engine.sessions.import_(data, None).result(10)
