"""Bookkeeping of a request in flight and of each of its rows (the n sampled sequences)."""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .constraint import GrammarConstraint, GrammarRuntime
from .detokenize import IncrementalDetokenizer, StopMatcher
from .sampling import SlotSampling, token_logprobs
from .sessions.records import APPLIED_TEXT_CHARS, ENTRY_TEXT_CHARS, TAIL_TOKENS, Session, TurnResult
from .state_pool import StatePool
from .types import EngineRequest, FinishReason, RequestOutput, RequestStats, TokenLogprob


@dataclass(slots=True)
class Row:
    """One sampled sequence. Constant size whatever its length: a token count and the last token; its
    sampling parameters and penalty statistics live in its slot's row of SlotSampling; per-token latencies
    go out with each step's stats, never into a list."""

    live: LiveRequest
    index: int
    slot: int
    detokenizer: IncrementalDetokenizer
    stop: StopMatcher
    # the request's constants a step reads for every row, copied here: a row's step touches the row, not its
    # request's three objects (what a big model's program evicted between steps: each one a cache miss)
    request_id: str
    prompt_tokens: int
    session_id: str | None
    max_tokens: int
    position: int  # the position of the token this row chooses next (its counter for the random draw)
    eos_ends: bool = True  # an end-of-text token ends the row (`ignore_eos` is off, or a grammar's end)
    next_token: int | None = None  # sampled, not yet consumed by the state
    num_generated: int = 0
    recent: collections.deque | None = None  # a session row's last tokens (its next tail); None otherwise
    finished: bool = False
    last_time: float | None = None
    reason: FinishReason | None = None
    constraint: GrammarConstraint | None = None  # structured outputs: what the grammar allows next
    kept: str | None = None  # its text so far, for a session turn made with an Idempotency-Key (bounded)
    parked: dict | None = None  # preempted: its state and sampling row, off the pool until it gets a slot again
    said: str | None = None  # a session row's text, its last `text_chars` characters (the turn's text)
    speculation: object | None = None  # speculation.RowSpeculation: its drafter (bounded) and acceptance
    next_logits: torch.Tensor | None = None  # (V,) set only when a failed step's program consumed next_token
    top_logprobs: int | None = None  # the request's `logprobs` (read for every row every step)

    def accept(self, token: int, logprob: TokenLogprob | None, now: float, eos_ids: frozenset[int],
               latencies: list[tuple[int, float]]) -> RequestOutput:
        """Record a sampled token (its latency into `latencies`); decide whether the row ends; build the output.
        (Every row, every step: locals over attribute reads, the row's own fields over its request's.)"""
        position = self.position
        self.position = position + 1
        generated = self.num_generated = self.num_generated + 1
        if self.recent is not None:
            self.recent.append(token)
        if self.speculation is not None:
            self.speculation.drafter.push(token)
        last = self.last_time
        if last is not None:
            latencies.append((position, now - last))
        elif self.live.first_token_time is None:
            self.live.first_token_time = now
        self.last_time = now
        self.next_token = token

        end_of_text = token in eos_ids
        reason, text, hit = None, "", False
        if end_of_text and self.eos_ends:
            reason = FinishReason.STOP
        elif self.stop.stops:  # stop strings are matched only for rows that have them
            text, hit = self.stop.push(self.detokenizer.add(token))
            if hit:
                reason = FinishReason.STOP
        else:
            text = self.detokenizer.add(token)
        if reason is None and generated >= self.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            if not hit:
                text += self.stop.flush()
            self.finished, self.reason = True, reason
        if self.kept is not None or self.said is not None:  # a session turn's text (most rows keep none)
            self._keep(text)
        return self.output(token, text, logprob, reason, position, end_of_text)

    def output(self, token: int | None, text: str, logprob: TokenLogprob | None, reason: FinishReason | None,
               position: int, end_of_text: bool = False, error: str | None = None) -> RequestOutput:
        """This row's event (positional, in RequestOutput's order: made once a row a step)."""
        return RequestOutput(self.request_id, self.index, token, text, logprob, reason, self.prompt_tokens,
                             self.num_generated, position, self.session_id, error, None, None, end_of_text)

    def consumed_pending(self, logits: torch.Tensor, committed: bool) -> None:
        """A decode program committed this row's state (`committed`: its logits were finite) and then the step
        failed: the pending token is consumed, `logits` (V,) predict what follows it."""
        if committed and self.next_token is not None:
            self.next_logits = logits.clone()

    def _say(self, text: str) -> None:
        if self.said is not None and text:
            self.said = (self.said + text)[-self.live.text_chars:]

    def finish_without_token(self, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self.finished, self.reason = True, reason
        text = self.stop.flush() if reason is not FinishReason.ERROR else ""
        self._keep(text)
        return self.output(None, text, None, reason, 0, error=error)

    def _keep(self, text: str) -> None:
        """The returned text of a keyed turn, to answer a retry with; past APPLIED_TEXT_CHARS (a stored response:
        ENTRY_TEXT_CHARS) none is kept."""
        self._say(text)
        if self.kept is not None and text:
            limit = ENTRY_TEXT_CHARS if self.live.request.idempotency.entry else APPLIED_TEXT_CHARS
            self.kept = self.kept + text if len(self.kept) + len(text) <= limit else None
            self.live.text_dropped |= self.kept is None


@dataclass
class LiveRequest:
    request: EngineRequest
    sink: Callable[[RequestOutput], None]
    feed: list[int]  # tokens to consume: the session's pending token(s), then the prompt
    session: Session | None
    decoder: object
    eos_ids: frozenset[int]  # the model's end-of-text ids (the tokenizer's, generation_config.json's)
    arrival: float
    rows: list[Row] = field(default_factory=list)
    prefix_hit: bool | None = None
    admitted_time: float | None = None
    first_token_time: float | None = None
    consumed: int = 0  # feed tokens consumed by the state so far
    last_logits: torch.Tensor | None = None  # (V,) after the last consumed feed token
    prefix_digest: bytes = b""  # prefix-cache key chain at the last block boundary consumed
    held: list[RequestOutput] | None = None  # final outputs waiting for the session turn's store write
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's tokens scored so far (when asked)
    text_dropped: bool = False  # a keyed turn's text outgrew what is kept to answer a retry
    text_chars: int = 0  # a session turn's text kept with the session, at most (session_text_chars)
    speculates: bool = False  # its rows may verify drafts (its `speculative`, or the server's default, is not off)

    base_position: int = field(init=False)  # the first generated token's position in the whole sequence

    def __post_init__(self) -> None:
        # (session history included: the session's count cannot change while its request runs — it is busy)
        self.base_position = (self.session.tokens if self.session else 0) + len(self.request.prompt_ids)

    def detokenizer_context(self) -> list[int]:
        """The last tokens before the first generated one: a character split across them decodes whole."""
        history = self.session.tail if self.session else []
        return (history + self.request.prompt_ids[-TAIL_TOKENS:])[-TAIL_TOKENS:]

    @property
    def constrained(self) -> bool:
        return self.request.params.grammar is not None

    def assign_slots(self, slots: list[int], now: float, sampling: SlotSampling,
                     grammars: GrammarRuntime | None = None) -> None:
        params = self.request.params
        skip = self.eos_ids
        self.admitted_time = now
        history = self.session.seen if self.session is not None else None
        for index, slot in enumerate(slots):
            # row i samples with seed + i (as a signed 64-bit value); unseeded rows get a random seed
            seed = (params.seed + index) % 2**64 if params.seed is not None else random.getrandbits(63)
            sampling.assign(slot, params, seed - 2**64 if seed >= 2**63 else seed, history, self.request.prompt_ids)
            detokenizer = IncrementalDetokenizer(self.decoder, skip, self.detokenizer_context())
            row = Row(self, index, slot, detokenizer, StopMatcher(params.stop), self.request.request_id,
                      len(self.request.prompt_ids), self.request.session_id, params.max_tokens, self.base_position,
                      eos_ends=not params.ignore_eos or grammars is not None,  # (a grammar's end is final)
                      top_logprobs=params.logprobs)
            if grammars is not None:  # the first token is drawn under the grammar's first mask
                row.constraint = GrammarConstraint(grammars, params.grammar, sampling.bias[slot])
                row.constraint.write(sampling.bias[slot], params.max_tokens)
            if self.session is not None:
                row.recent = collections.deque(maxlen=TAIL_TOKENS)
                row.kept = "" if self.request.idempotency is not None else None
                row.said = "" if self.text_chars else None
            self.rows.append(row)

    def row_for_slot(self, slot: int) -> Row:
        rows = self.rows
        if len(rows) == 1 and rows[0].slot == slot:  # (n = 1: every step, every row)
            return rows[0]
        return next(row for row in rows if row.slot == slot)

    def consumed_chunk(self, n_tokens: int, logits: torch.Tensor) -> None:
        self.consumed += n_tokens
        self.last_logits = logits

    def score_chunk(self, start: int, logits: torch.Tensor) -> None:
        """With prompt_logprobs: the log-probabilities of the prompt tokens that the chunk of the feed from
        `start` predicts (logits (t, V): position j predicts feed[start + j + 1]). The feed may begin with a
        session's pending token, which is not part of the prompt; the prompt's first token is predicted by the
        session's stored logits when it has them, else it has no logprob (None, as OpenAI's first token)."""
        top_n = self.request.params.prompt_logprobs
        offset = len(self.feed) - len(self.request.prompt_ids)  # feed index of the prompt's first token
        if start == 0:
            self.prompt_logprobs = []
            if offset == 0 and self.feed:
                history = self.session.logits if self.session is not None else None
                self.prompt_logprobs += [None] if history is None else token_logprobs(
                    history.to(logits.device)[None], torch.tensor(self.feed[:1], device=logits.device), [top_n])
        first = max(start + 1, offset)  # feed index of the first prompt token this chunk predicts
        end = min(start + logits.shape[0] + 1, len(self.feed))
        if end > first:
            targets = torch.tensor(self.feed[first:end], device=logits.device)  # (n,)
            self.prompt_logprobs += token_logprobs(logits[first - 1 - start : end - 1 - start], targets,
                                                   [top_n] * (end - first))  # (n, V) rows

    def prompt_done(self, pool: StatePool) -> None:
        """The prompt is in row 0's slot: fork it into the other rows (n > 1), no re-prefill."""
        for row in self.rows[1:]:
            pool.copy(self.rows[0].slot, row.slot)

    def final_outputs(self, reason: FinishReason, error: str | None = None) -> list[RequestOutput]:
        """The last event of every sequence that has not ended yet (abort or failure)."""
        if self.rows:
            return [row.finish_without_token(reason, error) for row in self.rows if not row.finished]
        # still waiting: every one of its n sequences ends
        request = self.request
        return [RequestOutput(request.request_id, index, None, "", None, reason, len(request.prompt_ids),
                              session_id=request.session_id, error=error) for index in range(request.params.n)]

    def turn_result(self, sampling: SlotSampling) -> TurnResult:
        """What this request did to its session, as plain values for the registry."""
        row = self.rows[0] if self.rows else None
        text = self.turn_text(row)
        if row is None or not row.num_generated:
            return TurnResult(self.request.prompt_ids, self.consumed, self.last_logits, applied=self.applied(row),
                              text=text)
        return TurnResult(self.request.prompt_ids, self.consumed, self.last_logits, row.num_generated,
                          sampling.counts[row.slot].clone(), row.next_token, tuple(row.recent or ()),
                          self.applied(row), text, row.next_logits)

    def turn_text(self, row: Row | None) -> tuple[str, str] | None:
        """(prompt, completion) as text for the session to keep: each at most its last `text_chars` characters
        (the prompt decoded from as many tokens at most: a token is at least one character)."""
        if not self.text_chars:
            return None
        prompt = self.decoder.decode(self.request.prompt_ids[-self.text_chars:])[-self.text_chars:]
        return prompt, (row.said or "") if row is not None else ""

    def applied(self, row: Row | None) -> dict | None:
        """What a keyed turn answered, for its session to remember (the result None when its text was too long):
        enough to answer a retry of the same request as the first attempt was answered."""
        key = self.request.idempotency
        if key is None:
            return None
        result = None
        if not self.text_dropped:
            reason = row.reason if row is not None and row.reason is not None else FinishReason.ABORT
            result = {"id": self.request.request_id, "created": key.created, "text": row.kept if row else "",
                      "finish_reason": reason.value, "prompt_tokens": len(self.request.prompt_ids),
                      "completion_tokens": row.num_generated if row else 0}
            if key.note is not None:
                result["note"] = key.note
        return {"key": key.key, "request": key.request, "result": result, **({"entry": True} if key.entry else {})}

    def request_stats(self, reason: FinishReason, now: float) -> RequestStats:
        admitted = self.admitted_time if self.admitted_time is not None else now
        return RequestStats(
            request_id=self.request.request_id,
            queue_wait_s=admitted - self.arrival,
            ttft_s=None if self.first_token_time is None else self.first_token_time - self.arrival,
            e2e_s=now - self.arrival,
            prompt_tokens=len(self.request.prompt_ids),
            generated_tokens=sum(row.num_generated for row in self.rows),
            finish_reason=reason,
            prefix_cache_hit=self.prefix_hit,
        )
