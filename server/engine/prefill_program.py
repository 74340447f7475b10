"""Short prompt chunks as one program: a chunk of up to T tokens for every row, from the rows' state in the pool,
the state after the chunk written back in place and the last token's logits returned — compiled per batch bucket
like the decode step (a `DecodeStep` of kind "prefill{T}", compiled_decode.py).

Eagerly, a 32-token chunk of the shipped model is ~2,500 small ATen calls (the exact numerics' lookups and tree
sums, the layer norms): ~9 ms against ~3 ms as one compiled program, and at 32 streams the core prefilled an
arriving request in a third of its steps (docs/benchmarks.md, "Where the served 32-stream load goes").

One program serves every chunk length up to T: a row's chunk is padded on the right to T tokens and its
`length` says where it ends. The model runs the T tokens keeping the state after every prefix (the verification
program's form, `forward(prefixes=True)`), and the row keeps the state after its own `length` tokens and the
logits there — the padding comes after them, so nothing of it reaches what is kept: in a recurrence a prefix's
state never depends on later tokens, and every projection row is its own fixed sequence of roundings
(model/kernels/invariant_linear.cpp). The bits are those of eager prefill, which are those of any other split of
the prompt (tests/server/engine/test_prefill_program.py). A chunk longer than T runs as several calls.

The state after every prefix is T states a row: the program is for models whose state is small
(`fits(model, T, rows)`); a large one (fla's 340M shapes: tens of MiB a row) prefills eagerly, where the
projections' arithmetic outweighs the calls anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linserve.model.decode_step import flat_prefill_step, state_names
from linserve.model.interface import ServedModel

MAX_PREFIX_BYTES = 64 << 20  # the states after every prefix one call may hold (all its rows)
PREFILL_ROWS = 2  # the largest bucket: chunks of equal length prefilled together (more run in several calls)
PIECES = 16  # a chunk of up to PIECES × T tokens runs as programs (faster up to 256 tokens: benchmarks/
# prefill_chunks.py); a longer one eagerly


@dataclass(frozen=True)
class PrefillKind:
    """The prefill program as a `DecodeStep` kind ("prefill{T}"; see decode_program.ProgramKind): io rows T token
    rows, then slots and lengths. Its artifacts live beside the decode step's (this file is one of every program's
    sources: compile/cache.py)."""

    name: str
    drafts: int = 0  # (not a verification)

    @property
    def tokens(self) -> int:
        return int(self.name.removeprefix("prefill"))

    @property
    def io_rows(self) -> int:
        return self.tokens + 2

    logits_output = 0  # the program's one output

    @property
    def label(self) -> str:
        return f"prefill step ({self.tokens} tokens)"

    def make(self, model: ServedModel):
        return prefill_program(model, self.tokens)

    def arguments(self, io: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return io[: self.tokens], io[self.tokens], io[self.tokens + 1]


def prefill_kind(tokens: int) -> PrefillKind:
    if tokens < 1:
        raise ValueError(f"a prefill program takes at least one token, got {tokens}")
    return PrefillKind(f"prefill{tokens}")


def fits(model: ServedModel, tokens: int, rows: int) -> bool:
    """Whether `rows` rows' states after each of `tokens` prefixes stay within MAX_PREFIX_BYTES."""
    return rows * tokens * model.state_bytes() <= MAX_PREFIX_BYTES


def prefill_program(model: ServedModel, tokens: int):
    """The chunk as one function of tensors — what gets compiled per bucket:

        program(ids (T, P), slots (P,), lengths (P,), *pool buffers, *SlotSampling tensors (not read))
            -> (logits (P, V) fp32 after each row's `length` tokens,)

    gather the rows' state by slot → the model over the T tokens, the state after every prefix kept and the head
    run at each row's last token only (`logits_at`: 1/T of the head's work, the same bits) → each row's
    state after its `length` tokens written into its slot (index_copy_ into the pool buffers, in place) and its
    logits there returned. Rows padded to a bucket repeat the first row (same slot, same values): their writes
    are the same bits."""
    step = flat_prefill_step(model)
    n_state = len(state_names(model))

    def program(ids: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pool = buffers[:n_state]
        state = [buffer.index_select(0, slots) for buffer in pool]  # (P, …) each
        last = lengths - 1  # (P,) where each row's chunk ends
        logits, *prefixes = step(ids.transpose(0, 1), last, *state)  # (P, V) there, then (P, T, …) each
        rows = torch.arange(slots.shape[0], device=slots.device)  # (P,)
        for buffer, every in zip(pool, prefixes):
            buffer.index_copy_(0, slots, every[rows, last].to(buffer.dtype))  # the state after the chunk, in place
        return (logits,)  # (P, V)

    return program
