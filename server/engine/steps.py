"""One engine step: decode a token for every running row, prefill chunks, sample, deliver.

A step commits nothing until its model work and sampling have succeeded: the decode state is scattered
back only after the next tokens are chosen, so a step that raises leaves every slot as consistent with
its request (and its session) as before the step. The engine fails the step's requests and goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .live import LiveRequest, Row
from .prefix_cache import boundary_hashes
from .sampling import BatchParams, apply_penalties, sample, token_logprobs
from .types import FinishReason, StepStats, TokenLogprob

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)

NON_FINITE = "the model produced non-finite logits for this sequence"


@dataclass(frozen=True)
class Choice:
    """Sampled tokens for a batch of rows, not yet delivered."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    broken: list[bool]  # rows whose logits were not finite: their requests fail


def logit_bias_rows(params: list, like: torch.Tensor) -> torch.Tensor:
    """Each row's `logit_bias` as a dense (B, V) tensor of additions (zeros where a row has none)."""
    rows = [b for b, p in enumerate(params) for _ in p.logit_bias]
    ids = [token for p in params for token, _ in p.logit_bias]
    values = torch.tensor([bias for p in params for _, bias in p.logit_bias], dtype=like.dtype)
    bias = torch.zeros_like(like)  # (B, V)
    bias[torch.tensor(rows), torch.tensor(ids)] = values.to(like.device)
    return bias


class StepExecution:
    """The model-facing half of the engine (mixed into Engine; runs on the engine thread only)."""

    def _step(self: Engine, plan) -> None:
        started = time.perf_counter()
        latencies: list[tuple[int, float]] = []
        if plan.decode:
            self._decode(plan.decode, latencies)
        if plan.prefill:
            self._prefill(plan.prefill, latencies)
        duration = time.perf_counter() - started
        phase = "mixed" if plan.decode and plan.prefill else ("decode" if plan.decode else "prefill")
        self.stats_sink(StepStats(duration_s=duration, phase=phase, batch_size=len(plan.decode),
                                  decode_tokens=len(plan.decode), prefill_tokens=plan.prefill_tokens,
                                  token_latencies=tuple(latencies)))
        self._emit_pool_stats()

    def _decode(self: Engine, decode: list[tuple[str, int]], latencies: list) -> None:
        rows = [self.live[seq_id].row_for_slot(slot) for seq_id, slot in decode]
        slots = [slot for _, slot in decode]
        tokens = [row.next_token for row in rows]
        if self.decode_step is not None:  # linear: eager or a compiled bucket / CUDA graph
            logits, state = self.decode_step(tokens, slots)  # (B, V) fp32
        else:
            ids = torch.tensor(tokens, device=self.device)[:, None]  # (B, 1)
            logits, state = self.model(ids, self.pool.gather(slots))  # (B, 1, V)
            logits = logits[:, 0].float()  # (B, V)
        choice = self._choose(rows, logits)  # may raise: nothing is committed yet
        self.pool.scatter(slots, state)
        self._deliver(rows, choice, latencies)

    def _prefill(self: Engine, work: list[tuple[str, int, int]], latencies: list) -> None:
        """Run this step's prefill chunks — those of equal length as one batch (exact: no padding) — then
        sample the first token of every prompt that is now complete, in one batch too."""
        by_length: dict[int, list[tuple[LiveRequest, int]]] = {}
        for seq_id, start, length in work:
            by_length.setdefault(length, []).append((self.live[seq_id], start))
        for length, members in by_length.items():
            if length == 0:  # a session continuing without a prompt: its stored logits
                for live, _ in members:
                    live.last_logits = live.session.logits.to(self.device)  # (V,)
                continue
            slots = [live.rows[0].slot for live, _ in members]
            ids = torch.tensor([live.feed[start : start + length] for live, start in members], device=self.device)
            logits, state = self.model(ids, self.pool.gather(slots))  # (B, t, V)
            self.pool.scatter(slots, state)
            last = logits[:, -1].float()  # (B, V)
            for b, (live, start) in enumerate(members):
                live.consumed_chunk(length, last[b])
                if live.session is None:
                    self._remember_prefix(live, start + length, live.rows[0].slot)
        rows, row_logits = [], []
        for seq_id, _, length in work:
            live = self.live[seq_id]
            if not self.scheduler.prefilled(seq_id, length):
                continue
            live.prompt_done(self.pool)
            if live.request.params.max_tokens == 0:  # prompt only (e.g. a session's first message)
                for row in live.rows:
                    output = row.finish_without_token(FinishReason.LENGTH)
                    self._retire_row(row, FinishReason.LENGTH)
                    self._emit(live, output)
                continue
            rows.extend(live.rows)
            row_logits.extend([live.last_logits] * len(live.rows))
        if rows:
            self._deliver(rows, self._choose(rows, torch.stack(row_logits)), latencies)  # (R, V)

    def _remember_prefix(self: Engine, live: LiveRequest, end: int, slot: int) -> None:
        block = self.prefix_cache.block
        if self.prefix_cache.capacity and end % block == 0 and end < len(live.feed):
            key = boundary_hashes(live.feed[end - block : end], block, live.prefix_digest)[0][1]
            live.prefix_digest = key  # the chain so far: the next boundary hashes one block, not the prefix
            self.prefix_cache.insert(key, self.pool.export(slot, self.device))

    def _choose(self: Engine, rows: list[Row], logits: torch.Tensor) -> Choice:
        """logits (B, V) → one token per row (penalties, filters, seeded draws), without side effects on
        slots or outputs."""
        params = [row.live.request.params for row in rows]
        bp = BatchParams.from_params(params, self.device)
        finite = torch.isfinite(logits).all(dim=-1)  # (B,) checked with the tokens: no extra device sync
        logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))  # (B, V) broken rows: anything
        processed = logits
        if any(p.logit_bias for p in params):
            processed = processed + logit_bias_rows(params, logits)  # (B, V)
        if bp.any_penalty:
            counts = torch.stack([row.counts if row.counts is not None else logits.new_zeros(self.vocab_size)
                                  for row in rows])  # (B, V)
            seen = torch.stack([row.seen if row.seen is not None else torch.zeros_like(counts[0], dtype=torch.bool)
                                for row in rows])  # (B, V)
            processed = apply_penalties(logits, counts, seen, bp)  # (B, V)
        uniforms = torch.tensor([row.uniform() for row in rows], device=self.device)  # (B,)
        tokens = sample(processed, bp, uniforms)  # (B,)
        logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
        chosen, ok = torch.stack([tokens, finite.long()]).tolist()  # (2, B): one transfer
        return Choice(chosen, logprobs, [not flag for flag in ok])

    def _deliver(self: Engine, rows: list[Row], choice: Choice, latencies: list) -> None:
        """Record each row's token, emit its output, retire finished rows; fail requests with broken rows."""
        failed = {row.live.request.request_id for row, bad in zip(rows, choice.broken) if bad}
        now = time.monotonic()
        for row, token, logprob in zip(rows, choice.tokens, choice.logprobs):
            if row.live.request.request_id in failed:
                continue
            output = row.accept(token, logprob, now, self.eos_id, latencies)
            if output.finished:  # stats first: whoever sees the last output also sees its metrics
                self._retire_row(row, output.finish_reason)
            self._emit(row.live, output)
        for request_id in failed:
            logger.error("request %s: %s", request_id, NON_FINITE)
            self._fail_request(request_id, NON_FINITE)

    def _retire_row(self: Engine, row: Row, reason: FinishReason) -> None:
        live = row.live
        if not self.scheduler.finish_row(live.request.request_id, row.slot):
            return
        self._finish_live(live, reason)
