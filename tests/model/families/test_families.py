"""The model interface's invariants for every fla family (design invariants 1, 3, 4): the chunkwise form and
the recurrence are the same function at any split; the state after every prefix is the state of that prefix;
in the default bf16 a row's bits do not depend on its batch or on how its tokens were split; the state's
bytes are the config's formula and never grow."""

from __future__ import annotations

import pytest
import torch

from linserve.model.checkpoint import load_checkpoint
from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint

T = 70  # three chunks of the chunkwise form


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(request.param), FAMILY_CASES[request.param])


def ids_for(batch: int = 1, length: int = T, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 4096, (batch, length), generator=torch.Generator().manual_seed(seed))


def split_run(model, ids: torch.Tensor, split: int):
    """Prefill ids[:, :split] in one call, then every later token one at a time: logits (B, T, V), state."""
    logits, state = model(ids[:, :split])
    steps = [logits]
    for t in range(split, ids.shape[1]):
        step, state = model(ids[:, t:t + 1], state)
        steps.append(step)
    return torch.cat(steps, dim=1), state


def assert_states_close(got, want) -> None:
    """Every state tensor of `got` equals `want`'s to fp32 rounding (the chunkwise form vs the recurrence)."""
    for name, tensor in want.tensors().items():
        torch.testing.assert_close(got.tensors()[name], tensor, atol=2e-4, rtol=1e-4, msg=name)


@torch.no_grad()
def test_chunked_and_recurrent_forms_are_one_function_at_any_split(checkpoint):
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
    ids = ids_for()
    whole, state = model(ids)
    for split in (1, 17, 33, T - 1):
        logits, other = split_run(model, ids, split)
        torch.testing.assert_close(logits, whole, atol=2e-4, rtol=1e-4)
        assert_states_close(other, state)


@torch.no_grad()
def test_the_state_after_every_prefix_is_that_prefixs_state(checkpoint):
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
    ids = ids_for(2, 9)
    start = model(ids_for(2, 20, seed=5))[1]
    _, every = model(ids, start, prefixes=True)
    for j in (0, 4, 8):
        _, prefix = model(ids[:, :j + 1], start)
        assert_states_close(every.select_prefix(torch.tensor([j, j])), prefix)


@torch.no_grad()
def test_logits_at_one_position_a_row_are_the_bits_of_every_positions(checkpoint):
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.bfloat16)
    ids, at = ids_for(3, 9), torch.tensor([8, 0, 5])
    every, every_state = model(ids, prefixes=True)  # (3, 9, V)
    picked, state = model(ids, prefixes=True, logits_at=at)  # (3, V)
    assert picked.shape == (3, every.shape[-1])
    assert torch.equal(picked, every[torch.arange(3), at])
    assert all(torch.equal(state.tensors()[name], tensor) for name, tensor in every_state.tensors().items())


@torch.no_grad()
def test_in_bf16_a_rows_bits_do_not_depend_on_its_batch_or_its_split(checkpoint):
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.bfloat16)
    ids = ids_for(5, 40)
    batch_logits, batch_state = model(ids)
    alone_logits, alone_state = model(ids[2:3])
    assert torch.equal(batch_logits[2:3], alone_logits)
    split_logits, split_state = split_run(model, ids[2:3], 13)
    assert torch.equal(split_logits, alone_logits)
    for name, tensor in alone_state.tensors().items():
        assert torch.equal(batch_state.tensors()[name][2:3], tensor), name
        assert torch.equal(split_state.tensors()[name], tensor), name


@torch.no_grad()
def test_state_bytes_are_the_configs_formula_whatever_the_length(checkpoint):
    model = load_checkpoint(checkpoint, torch.device("cpu"), torch.float32)
    short = model(ids_for(1, 3))[1]
    long = model(ids_for(1, 300))[1]
    assert short.nbytes() == long.nbytes() == model.state_bytes() == model.config.state_bytes(10**6)
    assert all(t.dtype in (torch.float32, torch.int64) for t in long.tensors().values())
