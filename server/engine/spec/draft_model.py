"""Drafts from a small draft model (`speculative.method: "draft"`): the same tokenizer, its own (S, z) per slot.

The draft model proposes k tokens greedily in one program (`draft_program`: k + 1 recurrent steps from the
row's draft state — the last one consumes the k-th draft, so every outcome has its state) and keeps the draft
state after each of them; after verification the row's draft state is the one after its accepted drafts
(`DraftModel.rolled_back`), the same rollback as the served model's, by picking. The served model decides
every token (verify_program.py), so the draft's state is only an aid: it is never stored with a session, and
it is rebuilt from the row's recent tokens (its n-gram drafter's bounded history, `CONTEXT` tokens at most)
whenever it is not current — a new request, a session continued, a row moved to another slot (preemption),
or a step that decoded without drafting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linserve.model.decode_step import flat_decode_step, state_names
from linserve.model.interface import ServedModel

from ..state_pool import StatePool

CONTEXT = 256  # recent tokens a draft state is rebuilt from, at most


@dataclass(frozen=True)
class DraftKind:
    """The drafting program as a `DecodeStep` kind ("draft{k}"; see decode_program.ProgramKind): io rows
    pending, slots; its cache key also covers this file's source."""

    name: str
    drafts: int = 0  # (not a verification: no drafts of its own to check)
    io_rows: int = 2
    sources: tuple[str, ...] = ("spec/draft_model.py",)  # under the engine package (compile/cache.py)

    @property
    def k(self) -> int:
        return int(self.name.removeprefix("draft"))

    @property
    def label(self) -> str:
        return f"draft model step (k={self.k})"

    def make(self, model: ServedModel):
        return draft_program(model, self.k)

    def arguments(self, io: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return io[0], io[1]


def draft_program(model: ServedModel, k: int):
    """program(pending (P,), slots (P,), *draft pool buffers, *ignored) -> (drafts (P, k), *states (P, k+1, …))

    states[:, i] is the draft state after pending + d1 … di (in `state_names` order)."""
    step = flat_decode_step(model)
    n_state = len(state_names(model))

    def program(pending: torch.Tensor, slots: torch.Tensor, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = [buffer.index_select(0, slots) for buffer in buffers[:n_state]]  # (P, …) each
        token, drafts, states = pending, [], []
        for i in range(k + 1):
            logits, *state = step(token[:, None], *state)  # (P, V)
            states.append(state)
            token = logits.argmax(dim=-1)  # (P,)
            if i < k:
                drafts.append(token)
        stacked = [torch.stack([s[j] for s in states], dim=1) for j in range(n_state)]  # (P, k+1, …) each
        return (torch.stack(drafts, dim=1), *stacked)

    return program


class DraftModel:
    """The draft model's per-slot state and its drafting step (a `DecodeStep` of kind "draft{k}")."""

    def __init__(self, model: ServedModel, num_slots: int, device: torch.device) -> None:
        self.model, self.device = model.eval(), device
        self.pool = StatePool(model, num_slots, device)
        self.step = None  # compiled_decode.DecodeStep of kind "draft{k}", set by the engine

    def sync(self, rows) -> None:
        """Rebuild the draft state of rows whose state is not current (`RowSpeculation.draft_current`) from their
        recent tokens, the pending one last and not consumed: one chunked forward per distinct length."""
        by_length: dict[int, list] = {}
        for row in rows:
            if not row.speculation.draft_current(row):
                history = row.speculation.drafter.recent(CONTEXT + 1)
                by_length.setdefault(len(history) - 1, []).append((row, history[:-1]))
        for length, members in by_length.items():
            slots = torch.tensor([row.slot for row, _ in members], device=self.device)  # (b,)
            if length == 0:
                state = self.model.init_state(len(members), self.device)
            else:
                _, state = self.model(torch.tensor([context for _, context in members], device=self.device))  # (b, t)
            self.pool.scatter_tensors(slots, list(state.tensors().values()))
            for row, _ in members:
                row.speculation.draft_at(row, row.num_generated)

    def propose(self, rows) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy drafts of k tokens for each row (its pending token first), and the draft states after each."""
        out = self.step.run([[row.next_token for row in rows], [row.slot for row in rows]])
        return out[0].tolist(), out[1:]

    def rolled_back(self, rows, states: list[torch.Tensor], kept: list[int]) -> None:
        """Each row's draft state after its accepted drafts: current for the row as it is now (its new tokens
        delivered, the last one pending)."""
        index = torch.tensor([row.slot for row in rows], device=self.device)  # (P,)
        at = torch.tensor(kept, device=self.device)  # (P,)
        rows_index = torch.arange(len(rows), device=self.device)  # (P,)
        self.pool.scatter_tensors(index, [state[rows_index, at] for state in states])
        for row in rows:
            row.speculation.draft_at(row, row.num_generated)
