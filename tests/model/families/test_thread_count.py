"""The exact path's bits do not depend on the intra-op thread count: the engine changes it while it runs (more
threads for prefill, fewer when other processes hold the CPUs — server/engine/cpu_threads.py), so a prompt
prefilled on one thread and continued on two must be the prompt prefilled on two. Every family, bf16 (the CPU's
exact default), the chunked form over several chunks and the one-token step, logits and every state tensor."""

from __future__ import annotations

import pytest
import torch

from linserve.model import families, kernels
from linserve.model.checkpoint import load_served
from linserve.model.loading import DEFAULT_CHECKPOINT, in_dtype
from tests.model.families.checkpoints import BASE, FAMILY_CASES


def perturbed(name: str) -> torch.nn.Module:
    if name == "linear_gpt":
        return load_served(DEFAULT_CHECKPOINT, torch.device("cpu"))[0]
    torch.manual_seed(0)
    model = families.build({**BASE, **FAMILY_CASES[name]})
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn_like(parameter)
            parameter.copy_(noise * 0.3 if parameter.dim() > 1 else 1 + 0.1 * noise)
    return model


def tensors_of(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors_of(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in tensors_of(value)]
    return [t for value in vars(state).values() for t in tensors_of(value)]


def run_on(model, ids: torch.Tensor, threads: int, pool: bool = False) -> list[torch.Tensor]:
    """The forward over several chunks and one step on `threads` intra-op threads; `pool`: linserve's kernels'
    regions on their own pool (model/kernels/work_pool.h) instead of OpenMP's threads, as the engine thread runs a
    compiled program."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    switch = torch.ops.linserve.use_work_pool if kernels.load() else lambda on: False
    pooled = switch(pool)
    try:
        with torch.no_grad():
            state, chunks = None, []
            for start in range(0, ids.shape[1], 96):  # several prefill chunks
                logits, state = model(ids[:, start:start + 96], state)  # (B, t, V)
                chunks.append(logits)
            step, state = model(ids[:, :1], state)  # (B, 1, V): the recurrent form
        return [*chunks, step, *tensors_of(state)]
    finally:
        switch(pooled)
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["linear_gpt", *FAMILY_CASES])
def test_the_exact_forward_is_the_same_bits_on_one_thread_or_several(name):
    """…on OpenMP's threads or on the kernels' own pool."""
    model = in_dtype(perturbed(name), torch.bfloat16).eval()
    ids = torch.randint(1, 4000, (3, 250), generator=torch.Generator().manual_seed(1))  # (B, T)
    one = run_on(model, ids, 1)
    assert len(one) > 4
    for threads, pool in ((2, False), (3, False), (2, True)):
        several = run_on(model, ids, threads, pool)
        assert len(several) == len(one)
        for i, (a, b) in enumerate(zip(one, several)):
            assert torch.equal(a, b), (name, threads, pool, i, (a.float() - b.float()).abs().max().item())
