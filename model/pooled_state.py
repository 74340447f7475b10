"""A layer's recurrent state left where it lives — the state pool — for one decode step.

The decode program (server/engine/decode_program.py) hands a layer a `PooledState` (the pool's (N, H, dk, dv)
buffer and the rows' slots) instead of the rows' state gathered into a new tensor. A recurrence that can read it
in place (recurrence.run, delta_rule.run: one token on the CPU kernels) computes the token's outputs from the
slots and returns a `PendingUpdate` where the new state would be: S ← S·α + k ⊗ v, applied to the slots by
`commit` once the step knows which rows' logits were finite (a row that failed keeps its state). Anything else —
several tokens, no kernels — `gather`s the rows and goes on as with any state.

A family says which of its state tensors its layers take this way (`pooled_state_names`, model/interface.py);
the others are gathered and written back as before. Those of `folded_state_names` (the delta rule's and the gated
linear recurrence's, on the CPU kernels) go further: the commit
only notes each kept row's update as its slot's pending one (`PendingBuffers`, kept by the state pool) and the next
step's read applies it as it reads the slot, storing the result — the state moves twice a step, not three times.
Whatever else reads or copies a slot settles it first (server/engine/state_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels


@dataclass(frozen=True)
class PendingBuffers:
    """A pooled state's updates not yet written (folded into the next read): slot n's pending S ← S·α + k ⊗ u is
    (k[n], u[n], alpha[n]) where flag[n] is 1 (no α) or 2; 0: none, the slot is the state. α is per key dimension
    (a per-head gate, the delta rule's, is recorded as d_k equal factors)."""

    k: torch.Tensor  # (N, H, dk) fp32
    u: torch.Tensor  # (N, H, dv) fp32 (the delta rule's u, the linear recurrence's v)
    alpha: torch.Tensor  # (N, H, dk) fp32
    flag: torch.Tensor  # (N,) uint8

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.u, self.alpha, self.flag


@dataclass(frozen=True)
class PooledState:
    """One state tensor of a batch of rows, still in the pool: row b's is `pool[slots[b]]` (with its slot's
    pending update applied, where `pending` holds one)."""

    pool: torch.Tensor  # (N, H, dk, dv) fp32, the pool's buffer
    slots: torch.Tensor  # (B,) int64
    pending: PendingBuffers | None = None  # (a folded state's decode step: its commit folded into the next read)

    def gather(self) -> torch.Tensor:
        return self.pool.index_select(0, self.slots)  # (B, H, dk, dv)


@dataclass(frozen=True)
class PendingUpdate:
    """S ← S·α + k ⊗ v for each row's slot (the delta rule's v: its u), not yet written."""

    pool: torch.Tensor  # (N, H, dk, dv)
    slots: torch.Tensor  # (B,)
    k: torch.Tensor  # (B, H, dk) fp32
    v: torch.Tensor  # (B, H, dv) fp32
    alpha: torch.Tensor | None  # (B, H, dk) or (B, H) fp32, or None
    pending: PendingBuffers | None = None  # folded: the update is noted for the next read, not written

    def commit(self, keep: torch.Tensor) -> torch.Tensor:
        """Write the rows whose `keep` (B,) bool is set, in place — or, folded, note it as their slots' pending
        update; returns `keep` — the next commit's input, so a compiler keeps every commit and their order (the ops
        are declared functional; kernels/pooled_state.cpp)."""
        if self.pending is not None:
            return torch.ops.linserve.pending_record(*self.pending.tensors(), self.slots, self.k, self.v, self.alpha,
                                                     keep)
        return torch.ops.linserve.state_commit(self.pool, self.slots, self.k, self.v, self.alpha, keep)


def readable(state: object, tokens: int, prefixes: bool) -> bool:
    """Whether a recurrence reads `state` in place for this call: a `PooledState`, one token, no every-prefix
    states, on the CPU kernels."""
    return (isinstance(state, PooledState) and tokens == 1 and not prefixes and state.pool.device.type == "cpu"
            and kernels.load())


def gathered(state: torch.Tensor | PooledState) -> torch.Tensor:
    """The rows' state as a tensor, whichever form it came in."""
    return state.gather() if isinstance(state, PooledState) else state
