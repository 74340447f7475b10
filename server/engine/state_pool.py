"""Preallocated per-slot state tensors on the device, with exact byte accounting.

Every state tensor of the model (S, z and the convolution window per layer) gets one buffer of shape
(num_slots, …); a slot is an index into all of them. Sequences gather their slots into a batch before a
step and scatter the new state back after it.
"""

from __future__ import annotations

import torch

from linserve.model import ModelState, kernels
from linserve.model.interface import ServedModel, fixed_state, folded_state_names
from linserve.model.pooled_state import PendingBuffers


def slots_for_budget(memory_bytes: int, state_bytes: int) -> int:
    """How many sessions a memory budget holds."""
    return max(memory_bytes // state_bytes, 0)


def states_within(count: int, budget_mb: float, state_bytes: int) -> int:
    """`count` states, or as many as `budget_mb` holds where that is fewer (fla's 340M shapes: 25-68 MB each)."""
    return min(count, slots_for_budget(int(budget_mb * 2**20), max(state_bytes, 1)))


class SlotPool:
    """Slot bookkeeping shared by the pools: free list and exact byte accounting."""

    supports_sessions = True

    def __init__(self, buffers: dict[str, torch.Tensor], num_slots: int, n_layers: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        self.buffers = buffers  # name → (num_slots, …)
        self._buffer_list = list(buffers.values())  # the same, in order (the per-step scatter)
        self.num_slots, self.n_layers, self.device = num_slots, n_layers, device
        self.slot_bytes = sum(b[0].numel() * b.element_size() for b in buffers.values())
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first

    # ---- accounting ----
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def distinct_free_slots(self) -> int:
        """Equal to `free_slots` unless a slot was freed twice (what the accounting tests look for)."""
        return len(set(self._free))

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def bytes_total(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def bytes_in_use(self) -> int:
        return self.used_slots * self.slot_bytes

    def allocate(self) -> int | None:
        """An empty slot, or None when all are taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._reset(slot)
        return slot

    def _reset(self, slot: int) -> None:
        for buffer in self.buffers.values():
            buffer[slot].zero_()

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def _index(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.device)


class StatePool(SlotPool):
    """Fixed-size (S, z, conv window) states of a linear-attention model."""

    def __init__(self, model: ServedModel, num_slots: int, device: torch.device) -> None:
        if not fixed_state(model):
            raise ValueError("the state pool holds fixed-size (S, z) states: attention must be 'linear'")
        template = model.init_state(1, device).tensors()  # name → (1, …) fp32
        buffers = {
            name: torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=device) for name, t in template.items()
        }
        super().__init__(buffers, num_slots, model.config.n_layers, device)
        self.model = model
        if self.slot_bytes != model.state_bytes():
            raise AssertionError(
                f"state bytes {self.slot_bytes} differ from the config's formula {model.state_bytes()}"
            )
        # the folded states on the CPU kernels: each slot's update not yet written, applied by the next
        # decode step's read (model/pooled_state.py) — or here, by `settle`, before anything else reads the slot
        folded = folded_state_names(model) if device.type == "cpu" and kernels.load() else []
        self.pending: dict[str, PendingBuffers] = {}
        for name in folded:
            n, heads, dk, dv = buffers[name].shape
            self.pending[name] = PendingBuffers(torch.zeros(n, heads, dk), torch.zeros(n, heads, dv),
                                                torch.zeros(n, heads, dk), torch.zeros(n, dtype=torch.uint8))
        # pending_settle's lists: the folded buffers, then their pending k, u, α and flags
        self._settled = ([self.buffers[name] for name in self.pending],
                         *([getattr(pending, field) for pending in self.pending.values()]
                           for field in ("k", "u", "alpha", "flag")))

    def pending_tensors(self) -> list[torch.Tensor]:
        """The pending updates' tensors, four a folded state in the buffers' order (the decode program's inputs)."""
        return [tensor for name in self.buffers if name in self.pending for tensor in self.pending[name].tensors()]

    def settle(self, slots: list[int] | None = None) -> None:
        """Write the pending updates of `slots` (None: every slot) into the state, so the buffers are the states
        (the commit's arithmetic, kernels/pooled_state.cpp's pending_settle: every folded state in one call)."""
        if self.pending:
            torch.ops.linserve.pending_settle(*self._settled, None if slots is None else self._index(slots))

    def _clear(self, index: torch.Tensor) -> None:
        """The slots in `index` are being overwritten: their pending updates are void."""
        for pending in self.pending.values():
            pending.flag[index] = 0

    def _reset(self, slot: int) -> None:
        super()._reset(slot)
        self._clear(self._index([slot]))

    def gather(self, slots: list[int]) -> ModelState:
        index = self._index(slots)
        self.settle(slots)
        tensors = {name: buffer.index_select(0, index) for name, buffer in self.buffers.items()}  # (B, …)
        return self.model.state_from_tensors(tensors)

    def scatter(self, slots: list[int], state: ModelState) -> None:
        self.scatter_tensors(self._index(slots), list(state.tensors().values()))

    def scatter_tensors(self, index: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Write rows back to the slots in `index` (B,): `tensors` in the buffers' order (ModelState.tensors(),
        the decode program's state outputs)."""
        self._clear(index)
        for buffer, tensor in zip(self._buffer_list, tensors):
            buffer.index_copy_(0, index, tensor if tensor.dtype == buffer.dtype else tensor.to(buffer.dtype))

    def copy(self, src: int, dst: int) -> None:
        self.settle([src])
        self._clear(self._index([dst]))
        for buffer in self.buffers.values():
            buffer[dst].copy_(buffer[src])

    def export(self, slot: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """A copy of one slot's tensors (name → (…)), e.g. to offload to host memory."""
        self.settle([slot])
        return {name: buffer[slot].to(device, copy=True) for name, buffer in self.buffers.items()}

    def load(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        self._clear(self._index([slot]))
        for name, buffer in self.buffers.items():
            buffer[slot].copy_(tensors[name])
