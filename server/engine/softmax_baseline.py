"""The softmax baseline (`attention: softmax`) as a component of its own, so the same engine, load and metrics
serve both kinds and the engine core never asks which it has (model_kind.py chooses once).

`KVCachePool`: each layer's k and v get a (num_slots, H, max_context, dh) buffer and each slot a length. A
batch is gathered left-padded to its longest row (with a validity mask); after a step only the new entries
are written back. Reading grows with context, as a KV cache does; sessions, the prefix cache, preemption and
speculation, which need a fixed-size state, are not offered for these models. `KVCacheRunner`: its decode
step — the model over the gathered caches, then the shared sampling (no compiled program).
"""

from __future__ import annotations

import torch

from linserve.model import LinearGPT, ModelState

from .live import Row
from .state_pool import SlotPool
from .step_runner import Delivery, StepRunner
from .types import EngineError


def _is_kv(name: str) -> bool:
    return name.endswith(".k") or name.endswith(".v")


class KVCachePool(SlotPool):
    supports_sessions = False

    def __init__(self, model: LinearGPT, num_slots: int, max_context: int, device: torch.device) -> None:
        template = model.init_state(1, device).tensors()  # k, v (1, H, 0, dh); conv (1, W, C)
        buffers = {}
        for name, t in template.items():
            shape = (num_slots, t.shape[1], max_context, t.shape[3]) if _is_kv(name) else (num_slots, *t.shape[1:])
            buffers[name] = torch.zeros(shape, dtype=t.dtype, device=device)
        super().__init__(buffers, num_slots, model.config.n_layers, device)
        self.max_context = max_context
        self.lengths = [0] * num_slots
        if self.slot_bytes != model.config.state_bytes(max_context):
            raise AssertionError("KV slot bytes differ from the config's formula")

    def _reset(self, slot: int) -> None:
        self.lengths[slot] = 0
        for name, buffer in self.buffers.items():
            if not _is_kv(name):
                buffer[slot].zero_()

    def gather(self, slots: list[int]) -> ModelState:
        lengths = [self.lengths[s] for s in slots]
        longest = max(lengths)
        tensors = {}
        for name, buffer in self.buffers.items():
            if not _is_kv(name):
                tensors[name] = buffer.index_select(0, self._index(slots))
                continue
            batch = buffer.new_zeros(len(slots), buffer.shape[1], longest, buffer.shape[3])  # (B, H, Tmax, dh)
            for row, (slot, length) in enumerate(zip(slots, lengths)):
                if length:
                    batch[row, :, longest - length :] = buffer[slot, :, :length]
            tensors[name] = batch
        if longest and min(lengths) < longest:
            positions = torch.arange(longest, device=self.device)[None, :]  # (1, Tmax)
            valid = positions >= torch.tensor([longest - n for n in lengths], device=self.device)[:, None]  # (B, Tmax)
            for i in range(self.n_layers):
                tensors[f"blocks.{i}.valid"] = valid
        return ModelState.from_tensors(tensors, self.n_layers, "softmax")

    def scatter(self, slots: list[int], state: ModelState) -> None:
        longest = max(self.lengths[s] for s in slots)
        tensors = state.tensors()
        new = tensors["blocks.0.k"].shape[2] - longest
        if any(self.lengths[s] + new > self.max_context for s in slots):
            raise EngineError(f"the KV cache is full (max context {self.max_context} tokens)", param="max_tokens")
        index = self._index(slots)
        for name, tensor in tensors.items():
            if name.endswith(".valid"):
                continue
            if not _is_kv(name):
                self.buffers[name].index_copy_(0, index, tensor)
                continue
            for row, slot in enumerate(slots):
                start = self.lengths[slot]
                self.buffers[name][slot, :, start : start + new] = tensor[row, :, longest:]
        for slot in slots:
            self.lengths[slot] += new

    def copy(self, src: int, dst: int) -> None:
        for buffer in self.buffers.values():
            buffer[dst].copy_(buffer[src])
        self.lengths[dst] = self.lengths[src]

    def export(self, slot: int, device="cpu"):
        raise EngineError("sessions and the prefix cache need a linear-attention model", param="model")

    def load(self, slot: int, tensors) -> None:
        raise EngineError("sessions and the prefix cache need a linear-attention model", param="model")


class KVCacheRunner(StepRunner):
    """The step runner with the KV cache's decode (prefill, scoring and delivery are the shared ones)."""

    def decode(self, rows: list[Row], speculate: bool = True) -> Delivery:
        slots = [row.slot for row in rows]
        ids = torch.tensor([row.next_token for row in rows], device=self.device)[:, None]  # (B, 1)
        logits, state = self.model(ids, self.pool.gather(slots))  # (B, 1, V)
        sampled = self.choose(rows, logits[:, 0].float())  # may raise: nothing is committed yet
        self.pool.scatter(slots, state)
        delivery = self.deliver(rows, sampled)
        delivery.tokens = len(rows)
        return delivery


def check_context(feed: int, max_tokens: int, max_context: int) -> None:
    """A request whose prompt and answer cannot fit the KV cache is refused before it queues."""
    if feed + max_tokens > max_context:
        raise EngineError(f"prompt ({feed} tokens) + max_tokens ({max_tokens}) exceeds this softmax model's max "
                          f"context of {max_context} tokens", param="max_tokens")
