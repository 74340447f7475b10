"""The model-facing half of an engine step: decode a token for every running row, prefill prompt chunks,
sample — and hand back what to deliver. It holds the model, the state pool, the decode step, the sampler's
inputs and the prefix cache; it never ends a request or talks to a client (the engine core does, with what
each phase returns).

A phase leaves every slot consistent with its request (and its session) whatever raises: prefill scatters its
state back only after its work has succeeded; the decode program commits its rows' state and its draws' penalty
counts itself (in place, the finite rows only) — if what follows it raises, the counts are taken back and each row
records that its pending token was consumed, the program's logits its next distribution; the verification program
commits too, and if what follows it raises, the state it read is written back and its counts taken back (the rows'
next tokens stay pending). The core fails the step's requests and goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from .constraint import write_rows
from .cpu_contention import ThreadCounts
from .cpu_threads import ThreadPlan
from .decode_program import DecodeOutputs
from .live import LiveRequest, Row
from .prefill_program import PIECES
from .prefix_cache import PrefixCache, boundary_hashes
from .sampling import SlotSampling, choose_tokens, sample_filtered, token_logprobs
from .spec.speculation import Plan, SpeculationPolicy
from .spec.verify_program import VerifyOutputs
from .types import FinishReason, RequestOutput, TokenLogprob

logger = logging.getLogger(__name__)

NON_FINITE = "the model produced non-finite logits for this sequence"
EAGER_PREFILL_STATE_BYTES = 64 << 20  # the rows' state one eager prefill call gathers (and makes anew): fla's
# 340M shapes hold 25–68 MB a row, and glibc keeps what a call freed (8 rows of Mamba2: +0.8 GB of RSS for good)


@dataclass(frozen=True)
class Sampled:
    """Sampled tokens for a batch of rows, not yet delivered."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    finite: list[int]  # 0 for rows whose logits were not finite: their requests fail


@dataclass
class Delivery:
    """What a phase produced, for the core to hand out in this order: each row's output (a finished one
    retires its row first), then the requests that failed."""

    outputs: list[tuple[Row, RequestOutput]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    latencies: list[tuple[int, float]] = field(default_factory=list)  # (position, seconds since the row's last)
    program_s: float = 0.0  # time inside the decode program (the rest of a step is Python around it)
    tokens: int = 0  # tokens decoded (a verification step emits accepted drafts too)
    drafted: int = 0  # speculative decoding: drafts verified, and accepted
    accepted: int = 0


def wanted_logprobs(rows: list[Row]) -> list[int | None] | None:
    """Each row's `logprobs` (top-N alternatives), or None when no row wants any."""
    top_n = [row.top_logprobs for row in rows]
    return top_n if any(n is not None for n in top_n) else None


def with_prompt_logprobs(output: RequestOutput, scored: list[TokenLogprob | None] | None) -> RequestOutput:
    return output if scored is None else dataclasses.replace(output, prompt_logprobs=tuple(scored))


class StepRunner:
    def __init__(self, model, pool, sampling: SlotSampling, decode_step, prefix_cache: PrefixCache,
                 device: torch.device, eos_ids: frozenset[int], threads: ThreadPlan | None = None,
                 verify_steps: dict | None = None, speculation: SpeculationPolicy | None = None,
                 prefill_step=None) -> None:
        self.model, self.pool, self.sampling, self.decode_step = model, pool, sampling, decode_step
        self.prefill_step = prefill_step  # short chunks as one compiled program (prefill_program.py), or None
        self.verify_steps, self.speculation = verify_steps, speculation  # width → verification DecodeStep
        self.prefix_cache, self.device, self.eos_ids = prefix_cache, device, eos_ids
        self._host_counted: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's redraws, counted
        self._rows: list[Row] | None = None  # the last decode step's rows, their slots and `logprobs` (None: none)
        self._slots: list[int] = []
        self._top_n: list[int | None] | None = None
        # the engine thread's CPU threads per phase (fewer while other processes hold the CPUs)
        self.threads = ThreadCounts(threads) if threads is not None and device.type == "cpu" else None

    # ------------------------------------------------------------------ phases
    def decode(self, rows: list[Row], speculate: bool = True) -> Delivery:
        """One token for every running row (more where a verification step accepts drafts: only when
        `speculate`, which the core clears while prompts are prefilled in the same step and while no live request
        speculates — the step is timed for the policy only then): one program (eager, a compiled bucket or a CUDA
        graph). The softmax baseline's: softmax_baseline.KVCacheRunner."""
        if rows is not self._rows:  # (the core passes the same list while no row starts, ends or moves)
            self._rows, self._slots, self._top_n = rows, [row.slot for row in rows], wanted_logprobs(rows)
            if self.threads is not None:
                self.threads.interrupt()
        slots = self._slots
        tokens = [row.next_token for row in rows]
        positions = [row.position for row in rows]
        step_started = time.perf_counter()  # (the policy compares whole steps: planning and delivery count)
        speculate = speculate and self.speculation is not None  # (and the step is timed for it: else no one asks)
        plan = self.speculation.plan(rows) if speculate else None
        if plan is not None:
            return self.verify(rows, plan, step_started)
        if self.threads is not None:
            bucket = self.decode_step.bucket_ready(len(rows))
            self.threads.decoding(bucket is not None, len(rows), ("decode", bucket))
        started = time.perf_counter()
        out = self.decode_step(tokens, slots, positions)  # (the program commits each finite row's new state)
        program_s = time.perf_counter() - started
        self._host_counted = None
        try:
            sampled = self._sampled(rows, out, slots, self._top_n, counted=True)  # (slots' tensor: redraws only)
            delivery = self.deliver(rows, sampled)
        except BaseException:
            self._undo_step(rows, out, torch.tensor(slots, device=self.device))
            raise
        delivery.program_s, delivery.tokens = program_s, len(rows)
        if speculate:
            self.speculation.observe("decode", len(rows), time.perf_counter() - step_started)
        return delivery

    def _undo_step(self, rows: list[Row], out: DecodeOutputs, index: torch.Tensor) -> None:
        """After a decode program, something raised: the step's tokens are never delivered, so their counts are
        taken back (the program's, and the host's redraws if it got that far); the rows' states have consumed
        their pending tokens, so each row takes the program's logits as its next distribution — a session keeps
        a state and a history consistent with each other when its request fails."""
        drawn = out.finite & ~out.redraw  # (B,) what the program counted
        self.sampling.unrecord(index[drawn], out.tokens[drawn])
        if self._host_counted is not None:
            self.sampling.unrecord(*self._host_counted)
        for b, row in enumerate(rows):
            row.consumed_pending(out.logits[b], bool(out.finite[b]))

    def verify(self, rows: list[Row], plan: Plan, step_started: float) -> Delivery:
        """Speculative decoding: every row's drafts verified in one program (verify_program.py), which writes each
        row's state after its accepted drafts and their counts; each row gets its accepted drafts and the next
        token. If delivering fails, the rows' states and counts are put back as they were (`_undo_verification`)."""
        k, drafts = plan.width, plan.drafts
        limits = [len(draft) for draft in drafts]
        ids = [[row.next_token, *draft] + [row.next_token] * (k - len(draft)) for row, draft in zip(rows, drafts)]
        slots = [row.slot for row in rows]
        self.pool.settle(slots)  # (the verification program reads the slots as they are: no pending update in them)
        if self.threads is not None:
            bucket = self.verify_steps[k].bucket_ready(len(rows))
            self.threads.decoding(bucket is not None, len(rows), (f"verify{k}", bucket))
        started = time.perf_counter()
        raw = self.verify_steps[k].run([*map(list, zip(*ids)), limits, slots, [row.position for row in rows]])
        program_s = time.perf_counter() - started
        out = VerifyOutputs(*raw[:9], before=raw[9:])
        self._host_counted = None
        try:
            sampled = self._sampled(rows, DecodeOutputs(out.next, out.finite, out.uniforms, out.processed, out.logits,
                                                        out.redraw, out.table[:, k + 2 :]), slots,
                                    wanted_logprobs(rows), counted=True)  # (the program counted the rest)
            table = out.table.tolist()  # (B, k+5): one transfer
            kept = [line[k + 1] for line in table]
            delivery = self.deliver(rows, sampled, [line[:n] for line, n in zip(table, kept)])
        except BaseException:
            self._undo_verification(out, torch.tensor(slots, device=self.device))
            raise
        delivery.program_s, delivery.drafted, delivery.accepted = program_s, sum(limits), sum(kept)
        delivery.tokens = len(rows) + sum(kept)
        self.speculation.verified(rows, plan, limits, kept, time.perf_counter() - step_started)
        return delivery

    def _undo_verification(self, out: VerifyOutputs, index: torch.Tensor) -> None:
        """After a verification program, something raised: its tokens are never delivered, so the rows' states go
        back to what the program read (their next tokens still pending) and its counts — and the host's redraws',
        if it got that far — are taken back."""
        self.pool.scatter_tensors(index, out.before)
        P, width = out.emitted.shape  # (k + 1 positions)
        position = torch.arange(width, device=self.device)[None, :]  # (1, k+1)
        counted = out.finite[:, None] & ((position < out.kept[:, None])
                                         | ((position == out.kept[:, None]) & ~out.redraw[:, None]))  # (P, k+1)
        self.sampling.unrecord(index[:, None].expand(P, width)[counted], out.emitted[counted])
        if self._host_counted is not None:
            self.sampling.unrecord(*self._host_counted)

    def prefill(self, work: list[tuple[LiveRequest, int, int]]) -> None:
        """This step's prefill chunks (request, start, length) — through the compiled prefill program those that
        take as many of its calls (each row its own length: its padding is never read), eagerly those of equal
        length as one batch (exact: no padding); on the prefill thread count. The state moves on; the first
        tokens come from `first_tokens` once a prompt is whole."""
        with self.threads.prefilling() if self.threads is not None else contextlib.nullcontext():
            self._prefill(work)

    def _prefill(self, work: list[tuple[LiveRequest, int, int]]) -> None:
        eager: dict[int, list[tuple[LiveRequest, int]]] = {}
        programs: dict[int, list[tuple[LiveRequest, int, int]]] = {}  # by calls of the program: ⌈length / T⌉
        for live, start, length in work:
            if length == 0:  # a session continuing without a prompt: its stored logits
                live.last_logits = live.session.logits.to(self.device)  # (V,)
            elif live.request.params.prompt_logprobs is None and self._compiled_prefill(length):
                programs.setdefault(-(-length // self.prefill_step.kind.tokens), []).append((live, start, length))
            else:
                eager.setdefault(length, []).append((live, start))
        most = self.prefill_step.sizes[-1] if programs else 0
        for members in programs.values():
            for first in range(0, len(members), most):  # at most the largest bucket's rows a call
                group = members[first : first + most]
                if self.prefill_step.bucket_ready(len(group)) is None:  # (its bucket not ready: eagerly)
                    for live, start, length in group:
                        eager.setdefault(length, []).append((live, start))
                    continue
                self._consumed(group, None, self._prefill_program(group))
        for length, members in eager.items():
            # as many rows a call as EAGER_PREFILL_STATE_BYTES of their state allows (at least one; a row's bits
            # are the same in any batch), each group's state and progress moved on together
            per_call = max(1, EAGER_PREFILL_STATE_BYTES // max(1, self.pool.slot_bytes))
            slots = [live.rows[0].slot for live, _ in members]
            for first in range(0, len(members), per_call):
                group, group_slots = members[first : first + per_call], slots[first : first + per_call]
                ids = torch.tensor([live.feed[start : start + length] for live, start in group], device=self.device)
                # the head at the chunk's last token only, unless prompt logprobs score every position (the same
                # bits: the head's rows are row by row)
                scored = any(live.request.params.prompt_logprobs is not None for live, _ in group)
                at = None if scored else torch.full((len(group),), length - 1, device=self.device)
                logits, state = self.model(ids, self.pool.gather(group_slots), logits_at=at)  # (g, t, V) or (g, V)
                self.pool.scatter(group_slots, state)
                del state  # (freed before the next group's is made)
                chunks = [(live, start, length) for live, start in group]
                if scored:
                    self._consumed(chunks, logits, logits[:, -1].float())
                else:
                    self._consumed(chunks, None, logits.float())

    def _consumed(self, members: list[tuple[LiveRequest, int, int]], logits: torch.Tensor | None,
                  last: torch.Tensor) -> None:
        """The rows' chunks (request, start, length) are in their state: prompt logprobs scored from `logits`
        (B, t, V), the logits after each chunk `last` (B, V) kept, a stateless prompt's boundary remembered."""
        for b, (live, start, length) in enumerate(members):
            if live.request.params.prompt_logprobs is not None:
                live.score_chunk(start, logits[b])
            live.consumed_chunk(length, last[b])
            if live.session is None:
                self._remember_prefix(live, start + length, live.rows[0].slot)

    def _compiled_prefill(self, length: int) -> bool:
        """Whether a chunk of `length` tokens may run as prefill programs: short enough, and the program's
        one-row bucket compiled and ready — never the eager form of the program, which keeps every prefix's state
        (the model's own eager forward is the faster eager)."""
        step = self.prefill_step
        return step is not None and length <= PIECES * step.kind.tokens and step.bucket_ready(1) is not None

    def _prefill_program(self, members: list[tuple[LiveRequest, int, int]]) -> torch.Tensor:
        """Chunks (request, start, length) that take as many calls of the compiled prefill program, T tokens a
        call, at most the largest bucket's rows: each call's rows padded on the right and told their own length
        (every row has at least one token in every call); the program writes the state. Returns the logits
        after each chunk, (B, V) fp32."""
        step = self.prefill_step
        T = step.kind.tokens
        slots = [live.rows[0].slot for live, _, _ in members]
        before = self.pool.gather(slots)  # (a copy: put back if a call raises — the slots stay as they were)
        try:
            for offset in range(0, max(length for _, _, length in members), T):
                chunks = [live.feed[start + offset : start + min(length, offset + T)]
                          for live, start, length in members]
                ids = [chunk + [0] * (T - len(chunk)) for chunk in chunks]
                (logits,) = step.run([*map(list, zip(*ids)), slots, [len(chunk) for chunk in chunks]])  # (B, V)
        except BaseException:
            self.pool.scatter(slots, before)
            raise
        return logits

    def first_tokens(self, done: list[LiveRequest]) -> Delivery:
        """The first token of every request whose prompt is now whole, sampled in one batch (a prompt-only
        request — max_tokens 0 — ends here without one)."""
        delivery, rows, row_logits = Delivery(), [], []
        for live in done:
            live.prompt_done(self.pool)
            if live.request.params.max_tokens == 0:  # prompt only (e.g. a session's first message)
                delivery.outputs += [(row, row.finish_without_token(FinishReason.LENGTH)) for row in live.rows]
                continue
            rows.extend(live.rows)
            row_logits.extend([live.last_logits] * len(live.rows))
        if rows:
            sampled = self.deliver(rows, self.choose(rows, torch.stack(row_logits)))  # (R, V)
            delivery.outputs += sampled.outputs
            delivery.failed += sampled.failed
            delivery.latencies += sampled.latencies
        if any(live.prompt_logprobs is not None for live in done):  # each row's first output carries them
            delivery.outputs = [(row, with_prompt_logprobs(output, row.live.prompt_logprobs))
                                for row, output in delivery.outputs]
            for live in done:
                live.prompt_logprobs = None
        return delivery

    # ------------------------------------------------------------------ sampling and delivery
    def choose(self, rows: list[Row], logits: torch.Tensor) -> Sampled:
        """logits (B, V) → one token per row (eagerly, with the decode program's sampling), without side
        effects on slots or outputs other than the rows' penalty counts."""
        slots = [row.slot for row in rows]
        index = torch.tensor(slots, device=self.device)  # (B,)
        positions = torch.tensor([row.position for row in rows], device=self.device)  # (B,)
        tokens, finite, uniforms, processed, redraw = choose_tokens(logits, index, positions, *self.sampling.tensors())
        outputs = DecodeOutputs(tokens, finite, uniforms, processed, logits, redraw)
        return self._sampled(rows, outputs, slots, wanted_logprobs(rows), index)

    def _sampled(self, rows: list[Row], out: DecodeOutputs, slots: list[int], top_n: list[int | None] | None,
                 index: torch.Tensor | None = None, counted: bool = False) -> Sampled:
        """A program's draw → the rows' tokens, in one transfer to Python: the program drew top-k where it could;
        rows whose filters it could not apply (`out.redraw`; every filtered row when a program does not say) are
        redrawn here from the processed logits with their own uniforms (their tokens a second transfer, only
        then); then the counts are recorded — only the redrawn rows' when the program `counted` its own draws
        (the decode program does). `top_n`: the rows' `logprobs` (`wanted_logprobs`)."""
        tokens = out.tokens
        table = out.table.t() if out.table is not None else torch.stack(  # (the decode program made it)
            [tokens, out.finite.long(), *([] if out.redraw is None else [out.redraw.long()])])
        chosen, ok, *redraw = table.tolist()  # (2 or 3, B)
        if redraw:  # (the program's flags imply the row's filters: no per-row look at its parameters)
            filtered = [b for b, flag in enumerate(redraw[0]) if flag] if any(redraw[0]) else ()
        else:
            filtered = [b for b, row in enumerate(rows) if row.live.request.params.uses_filters]
        if filtered:
            pick = torch.tensor(filtered, device=self.device)  # (b,)
            where = torch.tensor([slots[b] for b in filtered], device=self.device)  # (b,) their slots
            redrawn = sample_filtered(out.processed.index_select(0, pick), self.sampling.floats[0, where],
                                      self.sampling.top_k[where], self.sampling.floats[1, where],
                                      self.sampling.floats[2, where], out.uniforms.index_select(0, pick))  # (b,)
            tokens = tokens.index_copy(0, pick, redrawn)  # (B,)
            chosen = tokens.tolist()
            if counted:
                self.sampling.record(where, redrawn)
                self._host_counted = (where, redrawn)
        if not counted:
            self.sampling.record(index if index is not None else torch.tensor(slots, device=self.device), tokens)
        logprobs = [None] * len(rows) if top_n is None else token_logprobs(out.logits, tokens, top_n)
        return Sampled(chosen, logprobs, ok)

    def deliver(self, rows: list[Row], sampled: Sampled, accepted: list[list[int]] | None = None) -> Delivery:
        """Record each row's token (after its accepted drafts, when it verified some) and make its outputs;
        requests with a broken row fail instead. A row that ends on an accepted draft drops what follows."""
        delivery = Delivery()
        outputs, latencies, eos_ids = delivery.outputs, delivery.latencies, self.eos_ids
        failed = set() if all(sampled.finite) else {row.request_id for row, ok in zip(rows, sampled.finite)
                                                    if not ok}
        now = time.monotonic()
        constrained = []
        for b, (row, token, logprob) in enumerate(zip(rows, sampled.tokens, sampled.logprobs)):
            if failed and row.request_id in failed:
                continue
            if accepted is not None and self._accept_drafts(row, accepted[b], now, outputs, latencies):
                continue  # (it ended on an accepted draft)
            output = row.accept(token, logprob, now, eos_ids, latencies)
            outputs.append((row, output))
            if row.constraint is not None and not output.finished:
                row.constraint.accept(token)
                constrained.append(row)
        if constrained:  # the next position's masks, into the rows' bias (an input of the decode program)
            slots = torch.tensor([row.slot for row in constrained], device=self.device)  # (R,)
            left = [row.max_tokens - row.num_generated for row in constrained]
            rows_bias = write_rows([row.constraint for row in constrained], self.sampling.bias[slots], left)
            self.sampling.bias.index_copy_(0, slots, rows_bias)
        for request_id in failed:
            logger.error("request %s: %s", request_id, NON_FINITE)
            delivery.failed.append((request_id, NON_FINITE))
        return delivery

    def _accept_drafts(self, row: Row, drafts: list[int], now: float, outputs: list, latencies: list) -> bool:
        """A verified row's accepted drafts, each an output; True when the row ended on one (what follows drops)."""
        for draft in drafts:
            output = row.accept(draft, None, now, self.eos_ids, latencies)
            outputs.append((row, output))
            if output.finished:
                return True
        return False

    def _remember_prefix(self, live: LiveRequest, end: int, slot: int) -> None:
        block = self.prefix_cache.block
        if self.prefix_cache.capacity and end % block == 0 and end < len(live.feed):
            key = boundary_hashes(live.feed[end - block : end], block, live.prefix_digest)[0][1]
            live.prefix_digest = key  # the chain so far: the next boundary hashes one block, not the prefix
            self.prefix_cache.insert(key, self.pool.export(slot, self.device))
