"""Bookkeeping of a request in flight and of each of its rows (the n sampled sequences)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer, StopMatcher
from .sessions import Session
from .state_pool import StatePool
from .types import EngineRequest, FinishReason, RequestOutput, RequestStats, TokenLogprob


@dataclass
class Row:
    live: LiveRequest
    index: int
    slot: int
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    next_token: int | None = None  # sampled, not yet consumed by the state
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    last_time: float | None = None
    latencies: list[tuple[int, float]] = field(default_factory=list)
    _counts: torch.Tensor | None = None  # (V,) generated-token counts (penalties only)
    _seen: torch.Tensor | None = None  # (V,) prompt or generated (penalties only)

    def uniform(self) -> float:
        return 0.0 if self.generator is None else float(torch.rand(1, generator=self.generator))

    def penalty_counts(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None:
            self._counts = torch.zeros(vocab, device=device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            context = self.live.context_tokens()
            if context:
                self._seen[torch.tensor(context, device=device)] = True
            for token in self.generated:
                self._counts[token] += 1
                self._seen[token] = True
        return self._counts, self._seen

    def accept(self, token: int, logprob: TokenLogprob | None, now: float, eos_id: int | None) -> RequestOutput:
        """Record a sampled token; decide whether the row ends; build the output event."""
        params = self.live.request.params
        self.generated.append(token)
        if self._counts is not None:
            self._counts[token] += 1
            self._seen[token] = True
        position = self.live.base_position + len(self.generated) - 1
        if self.last_time is not None:
            self.latencies.append((position, now - self.last_time))
        elif self.live.first_token_time is None:
            self.live.first_token_time = now
        self.last_time = now
        self.next_token = token

        reason, text, hit = None, "", False
        if token == eos_id and not params.ignore_eos:
            reason = FinishReason.STOP
        else:
            text, hit = self.stop.push(self.detokenizer.add(token))
            if hit:
                reason = FinishReason.STOP
        if reason is None and len(self.generated) >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None and not hit:
            text += self.stop.flush()
        self.finished = reason is not None
        return self.live.output(self.index, token, text, logprob, reason, len(self.generated), position)

    def finish_without_token(self, reason: FinishReason) -> RequestOutput:
        self.finished = True
        return self.live.output(self.index, None, self.stop.flush(), None, reason, len(self.generated), 0)

    def abort_output(self) -> RequestOutput:
        return self.finish_without_token(FinishReason.ABORT)


@dataclass
class LiveRequest:
    request: EngineRequest
    sink: Callable[[RequestOutput], None]
    feed: list[int]  # tokens to consume: the session's pending token(s), then the prompt
    session: Session | None
    decoder: object
    eos_id: int | None
    arrival: float
    rows: list[Row] = field(default_factory=list)
    prefix_hit: bool | None = None
    admitted_time: float | None = None
    first_token_time: float | None = None
    consumed: int = 0  # feed tokens consumed by the state so far
    last_logits: torch.Tensor | None = None  # (V,) after the last consumed feed token

    @property
    def base_position(self) -> int:
        """Position of the first generated token in the whole sequence (session history included)."""
        return (self.session.tokens if self.session else 0) + len(self.request.prompt_ids)

    def context_tokens(self) -> list[int]:
        history = self.session.transcript if self.session else []
        return history + self.request.prompt_ids

    def assign_slots(self, slots: list[int], now: float) -> None:
        params = self.request.params
        skip = frozenset() if self.eos_id is None else frozenset({self.eos_id})
        self.admitted_time = now
        for index, slot in enumerate(slots):
            generator = None
            if not params.greedy:
                seed = params.seed + index if params.seed is not None else random.getrandbits(63)
                generator = torch.Generator().manual_seed(seed)
            self.rows.append(Row(self, index, slot, generator, IncrementalDetokenizer(self.decoder, skip), StopMatcher(params.stop)))

    def row_for_slot(self, slot: int) -> Row:
        return next(row for row in self.rows if row.slot == slot)

    def consumed_chunk(self, n_tokens: int, logits: torch.Tensor) -> None:
        self.consumed += n_tokens
        self.last_logits = logits

    def prompt_done(self, pool: StatePool) -> None:
        """The prompt is in row 0's slot: fork it into the other rows (n > 1), no re-prefill."""
        for row in self.rows[1:]:
            pool.copy(self.rows[0].slot, row.slot)

    def output(self, index, token, text, logprob, reason, generated, position) -> RequestOutput:
        return RequestOutput(
            request_id=self.request.request_id, index=index, token_id=token, text=text, logprob=logprob,
            finish_reason=reason, prompt_tokens=len(self.request.prompt_ids), generated_tokens=generated,
            position=position, session_id=self.request.session_id,
        )

    def abort_output(self, index: int = 0) -> RequestOutput:
        return self.output(index, None, "", None, FinishReason.ABORT, 0, 0)

    def request_stats(self, reason: FinishReason, now: float) -> RequestStats:
        admitted = self.admitted_time if self.admitted_time is not None else now
        return RequestStats(
            request_id=self.request.request_id,
            queue_wait_s=admitted - self.arrival,
            ttft_s=None if self.first_token_time is None else self.first_token_time - self.arrival,
            e2e_s=now - self.arrival,
            prompt_tokens=len(self.request.prompt_ids),
            generated_tokens=sum(len(row.generated) for row in self.rows),
            finish_reason=reason,
            token_latencies=tuple(lat for row in self.rows for lat in row.latencies),
            prefix_cache_hit=self.prefix_hit,
        )
