"""The decode step as one program: gather the rows' state by slot → the model's recurrent step → sampling →
the rows' new state written back into the pool, in place.

This is what gets compiled per batch bucket (compiled_decode.py: an AOTInductor artifact on CPU, built by
program_compiler.py in a child process; a CUDA graph of the compiled program on CUDA) and what runs
eagerly while no bucket is ready. Only tensors go in and out, so the same function can be exported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linserve.model import kernels
from linserve.model.decode_step import flat_decode_step, state_names
from linserve.model.interface import ServedModel, folded_state_names, pooled_state_names
from linserve.model.pooled_state import PendingBuffers, PendingUpdate, PooledState, gathered

from .sampling import SlotSampling, choose_tokens, count_tokens

COUNTS = SlotSampling.TENSORS.index("counts")  # where the counts come among the SlotSampling tensors


@dataclass
class DecodeOutputs:
    """What one decode program returns for B rows (see `decode_program`)."""

    tokens: torch.Tensor  # (B,) int64 drawn (argmax for greedy rows; top-k applied where the program can)
    finite: torch.Tensor  # (B,) bool: the row's logits were finite
    uniforms: torch.Tensor  # (B,) the rows' counter-based uniforms (a filtered redraw reuses them)
    processed: torch.Tensor  # (B, V) logits after logit_bias and penalties
    logits: torch.Tensor  # (B, V) the model's logits, fp32
    redraw: torch.Tensor | None  # (B,) bool: rows whose filters the host applies (None: every filtered row)
    table: torch.Tensor | None = None  # (B, 3) int64: tokens, finite, redraw — what the host reads, in one transfer


@dataclass(frozen=True)
class ProgramKind:
    """Which program a `DecodeStep` compiles and runs: the decode step ("decode") or speculative decoding's
    verification of k drafts ("verify{k}", verify_program.py). Both read their integer inputs from one
    (rows, P) io tensor — decode: tokens, slots, positions; verify: k + 1 token rows, limits, slots,
    positions — then the pool's buffers and the SlotSampling tensors."""

    name: str

    @property
    def drafts(self) -> int:
        return 0 if self.name == "decode" else int(self.name.removeprefix("verify"))

    @property
    def io_rows(self) -> int:
        return 3 if self.drafts == 0 else self.drafts + 4

    @property
    def logits_output(self) -> int:
        """Which of the program's outputs are the logits (DecodeOutputs' or VerifyOutputs' order)."""
        return 4 if self.drafts == 0 else 5

    def make(self, model: ServedModel):
        if self.drafts == 0:
            return decode_program(model)
        from .spec.verify_program import verify_program

        return verify_program(model, self.drafts)

    def arguments(self, io: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The program's leading arguments from its io tensor (rows, P)."""
        if self.drafts == 0:
            return io[0], io[1], io[2]
        return io[: self.drafts + 1], io[-3], io[-2], io[-1]


DECODE = ProgramKind("decode")


def verify_kind(k: int) -> ProgramKind:
    if k < 1:
        raise ValueError(f"speculative decoding verifies at least one draft, got k={k}")
    return ProgramKind(f"verify{k}")


def program_pending(pool, kind) -> list[torch.Tensor]:
    """The pool's pending updates where `kind` is the decode program (the one that applies and notes them:
    `decode_program`); [] for every other program, and for a pool that keeps none."""
    return list(getattr(pool, "pending_tensors", list)()) if getattr(kind, "name", None) == "decode" else []


def decode_program(model: ServedModel):
    """The whole decode step as one function of tensors — what gets compiled per bucket:

        program(tokens (P,), slots (P,), positions (P,), *pool buffers, *SlotSampling tensors, *pending updates)
            -> (tokens, finite, uniforms, processed, logits, redraw, table)

    gather the rows' state from the pool by slot (a state the family reads in place: handed over as the pool
    buffer and the slots, model/pooled_state.py) → the model's recurrent step → the rows' sampling
    parameters gathered by slot → penalties, logit_bias, counter-based draw (top-k too: sampling.choose_tokens)
    → the drawn token counted for the row's penalties (SlotSampling.counts; not a row whose draw the host
    redoes: the host counts its redraw) → each row's new state written into its slot (index_copy_ into the
    pool buffers, which the program mutates: the state is read and written once, never copied out and
    scattered back), except a row whose logits were not finite: its slot keeps the state it had (its request
    fails; a session stays at its last good token). Rows padded to a bucket repeat the first row (same slot,
    same values): their writes are the same bits. A state read in place comes back as a pending update, committed
    into the slots of the finite rows (each slot once) — the commits chained through `finite`, which the
    program returns. The folded states (every pooled state on the CPU kernels), whose pending updates the pool keeps
(`StatePool.pending_tensors`, after the sampling tensors), apply them as they are read and note the step's instead
(model/pooled_state.py).
`table` (P, 3): tokens, finite, redraw, for one transfer."""
    step = flat_decode_step(model)
    names = state_names(model)
    n_state, n_sampling = len(names), len(SlotSampling.TENSORS)
    on_kernels = next(model.parameters()).device.type == "cpu" and kernels.load()  # (the in-place ops are CPU's)
    pooled = set(pooled_state_names(model)) if on_kernels else set()
    folded = set(folded_state_names(model)) if on_kernels else set()
    in_place = [name in pooled for name in names]
    folds = [name in folded for name in names]

    def program(tokens: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pool, sampling = buffers[:n_state], buffers[n_state : n_state + n_sampling]
        kept = buffers[n_state + n_sampling :]  # the pool's pending updates, four a folded state (where it keeps them)
        pending = iter(kept)
        state = []
        for buffer, pooled, fold in zip(pool, in_place, folds):
            if not pooled:
                state.append(buffer.index_select(0, slots))  # (P, …)
                continue
            update = PendingBuffers(*(next(pending) for _ in range(4))) if fold and kept else None
            state.append(PooledState(buffer, slots, update))
        logits, *new_state = step(tokens[:, None], *state)  # (P, V) fp32
        tokens, finite, uniforms, processed, redraw = choose_tokens(logits, slots, positions, *sampling)
        counts = sampling[COUNTS]  # (N, V)
        count_tokens(counts, slots, tokens, finite & ~redraw)  # (a redrawn row is counted by the host's redraw)
        for buffer, old, new in zip(pool, state, new_state):
            if isinstance(new, PendingUpdate):
                finite = new.commit(finite)  # (P,) the same flags: the commits chained, in order
                continue
            keep = finite.view(-1, *([1] * (new.dim() - 1)))  # (P, 1, …)
            buffer.index_copy_(0, slots, torch.where(keep, new.to(buffer.dtype), gathered(old)))  # the commit
        table = torch.stack([tokens, finite.long(), redraw.long()], dim=1)  # (P, 3)
        return tokens, finite, uniforms, processed, logits, redraw, table

    return program
