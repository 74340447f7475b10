"""The engine: one thread owns the model, the state pool and every live request.

Callers (async handlers, tests, the CLI) talk to it only through `submit`, `abort` and the session
methods, which enqueue commands and return futures; outputs go to a per-request sink callable, called
on the engine thread. Each step decodes one token for every running row and spends the rest of a token
budget on chunked prefill, so a long prompt never stalls running streams.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from model import LinearGPT

from .live import LiveRequest, Row
from .kv_pool import KVCachePool
from .prefix_cache import PrefixCache, boundary_hashes
from .sampling import BatchParams, apply_penalties, sample, token_logprobs
from .scheduler import SchedSeq, Scheduler
from .session_manager import SessionManager
from .state_pool import StatePool
from .types import EngineError, EngineRequest, FinishReason, PoolStats, RequestOutput, StepStats

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
StatsSink = Callable[[object], None]


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int = 64
    max_batch_tokens: int = 640  # decode rows + prefill tokens per step
    max_prefill_chunk: int = 256
    max_prefill_while_decoding: int = 16  # prefill tokens per step while streams decode (their ITL bound)
    prefix_cache_entries: int = 64
    max_host_sessions: int = 1024
    session_ttl_s: float = 3600.0
    max_n: int = 8
    max_waiting: int = 256
    max_context: int = 8192  # softmax models only: KV-cache capacity per slot


class Engine:
    def __init__(self, model: LinearGPT, tokenizer, config: EngineConfig, device: torch.device,
                 stats_sink: StatsSink | None = None) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        # incremental detokenization calls decode twice per token: use the Rust tokenizer directly if there is one
        self.decoder = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.config = config
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.eos_id = tokenizer.eos_token_id
        self.linear = model.config.attention == "linear"
        self.pool = (StatePool(model, config.num_slots, device) if self.linear
                     else KVCachePool(model, config.num_slots, config.max_context, device))
        cache_entries = config.prefix_cache_entries if self.linear else 0
        self.prefix_cache = PrefixCache(cache_entries, config.max_prefill_chunk, self.pool.slot_bytes)
        self.sessions = SessionManager(self.pool, model, config.max_host_sessions, config.session_ttl_s)
        self.scheduler = Scheduler(self, config.max_batch_tokens, config.max_prefill_chunk,
                                   config.max_prefill_while_decoding)
        self.stats_sink = stats_sink or (lambda stats: None)
        self.live: dict[str, LiveRequest] = {}
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="linserve-engine", daemon=True)

    # ---------------------------------------------------------------- public, any thread
    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (finish reason `abort`) and end the thread."""
        if not self._thread.is_alive():
            return
        self._stopping.set()  # from here on new requests are refused
        self._commands.put(lambda: None)  # wake the loop
        self._thread.join(timeout)

    def submit(self, request: EngineRequest, sink: Sink) -> Future:
        """Future resolves once the request is accepted, or raises EngineError (bad input, busy, full)."""
        return self._call(lambda: self._accept(request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._abort(request_id))

    def create_session(self, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.create(owner))

    def session_info(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.info(self.sessions.get(session_id, owner)))

    def fork_session(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.fork(session_id, owner))

    def export_session(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.export(session_id, owner))

    def import_session(self, data: bytes, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.import_(data, owner))

    def delete_session(self, session_id: str, owner: str | None) -> Future:
        return self._call(lambda: self.sessions.delete(session_id, owner))

    def counts(self) -> Future:
        """(running, waiting, live) — for tests and health checks."""
        return self._call(lambda: (self.scheduler.num_running, self.scheduler.num_waiting, len(self.live)))

    # ---------------------------------------------------------------- engine thread
    def _call(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except Exception as error:  # noqa: BLE001 - delivered to the caller
                future.set_exception(error)

        if self._stopping.is_set():
            future.set_exception(EngineError("the engine is shutting down", kind="unavailable"))
        else:
            self._commands.put(command)
        return future

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands(block=not self.live)
            self.sessions.expire()
            plan = self.scheduler.schedule()
            if not plan.empty:
                with torch.inference_mode():
                    self._step(plan)
        self._abort_all()
        self._drain_commands(block=False)  # late commands still get an answer (new requests: unavailable)
        self._emit_pool_stats()

    def _drain_commands(self, block: bool) -> None:
        """Run queued commands; when idle, wait (up to a second, for housekeeping) for the first one."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._emit_pool_stats()
                return

    def _emit(self, live: LiveRequest, output: RequestOutput) -> None:
        try:
            live.sink(output)
        except Exception:  # noqa: BLE001 - a broken sink must not take the engine down
            logger.exception("output sink of %s failed; aborting it", live.request.request_id)
            self._commands.put(lambda: self._abort(live.request.request_id))

    def _accept(self, request: EngineRequest, sink: Sink) -> None:
        if self._stopping.is_set():
            raise EngineError("the engine is shutting down", kind="unavailable")
        if request.request_id in self.live:
            raise EngineError(f"duplicate request id {request.request_id}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineError("the request queue is full", kind="capacity")
        params = request.params
        if params.n > self.config.max_n:
            raise EngineError(f"n must be <= {self.config.max_n}", param="n")
        if any(not 0 <= t < self.vocab_size for t in request.prompt_ids):
            raise EngineError("prompt holds token ids outside the vocabulary", param="prompt")
        session = None
        feed = list(request.prompt_ids)
        if request.session_id is not None:
            if params.n != 1:
                raise EngineError("n must be 1 when continuing a session", param="n")
            session = self.sessions.acquire_for_request(request.session_id, request.owner)
            feed = session.pending + feed
            if not feed and session.logits is None:
                self.sessions.release(session)
                raise EngineError("the session is empty: send a prompt", param="prompt")
        elif not feed:
            raise EngineError("the prompt is empty", param="prompt")
        if not self.linear and len(feed) + params.max_tokens > self.config.max_context:
            raise EngineError(f"prompt ({len(feed)} tokens) + max_tokens ({params.max_tokens}) exceeds this softmax "
                              f"model's max context of {self.config.max_context} tokens", param="max_tokens")
        live = LiveRequest(request=request, sink=sink, feed=feed, session=session, decoder=self.decoder,
                           eos_id=self.eos_id, arrival=time.monotonic())
        self.live[request.request_id] = live
        self.scheduler.add(SchedSeq(request.request_id, to_prefill=len(feed), rows=params.n))

    # ---- SlotAllocator (called by the scheduler on this thread) ----
    def acquire(self, seq: SchedSeq) -> list[int] | None:
        live = self.live[seq.seq_id]
        if live.session is not None:
            slot = self.sessions.bring_to_device(live.session)
            if slot is not None:
                live.assign_slots([slot], time.monotonic())
            return None if slot is None else [slot]
        slots = []
        for _ in range(seq.rows):
            slot = self.sessions.allocate_slot()
            if slot is None:
                for taken in slots:
                    self.pool.free(taken)
                return None
            slots.append(slot)
        hit_len, entry = self.prefix_cache.lookup(live.feed)
        live.prefix_hit = entry is not None
        if entry is not None:
            self.pool.load(slots[0], entry)
            seq.prefilled = live.consumed = hit_len
        live.assign_slots(slots, time.monotonic())
        return slots

    def release(self, seq: SchedSeq, slots: list[int]) -> None:
        live = self.live.get(seq.seq_id)
        for slot in slots:
            if live is None or live.session is None or slot != live.session.slot:
                self.pool.free(slot)

    # ---- one step ----
    def _step(self, plan) -> None:
        started = time.perf_counter()
        if plan.decode:
            self._decode(plan.decode)
        if plan.prefill:
            self._prefill(plan.prefill)
        duration = time.perf_counter() - started
        phase = "mixed" if plan.decode and plan.prefill else ("decode" if plan.decode else "prefill")
        self.stats_sink(StepStats(duration_s=duration, phase=phase, batch_size=len(plan.decode),
                                  decode_tokens=len(plan.decode), prefill_tokens=plan.prefill_tokens))
        self._emit_pool_stats()

    def _emit_pool_stats(self) -> None:
        tiers = self.sessions.tier_counts()
        self.stats_sink(PoolStats(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting, slots_in_use=self.pool.used_slots,
            slots_total=self.pool.num_slots, state_bytes_in_use=self.pool.bytes_in_use,
            sessions_device=tiers["device"], sessions_host=tiers["host"],
        ))

    def _decode(self, decode: list[tuple[str, int]]) -> None:
        rows = [self.live[seq_id].row_for_slot(slot) for seq_id, slot in decode]
        slots = [slot for _, slot in decode]
        tokens = torch.tensor([[row.next_token] for row in rows], device=self.device)  # (B, 1)
        logits, state = self.model(tokens, self.pool.gather(slots))  # (B, 1, V)
        self.pool.scatter(slots, state)
        self._sample(rows, logits[:, 0].float())

    def _prefill(self, work: list[tuple[str, int, int]]) -> None:
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
            self._sample(rows, torch.stack(row_logits))  # (R, V)

    def _remember_prefix(self, live: LiveRequest, end: int, slot: int) -> None:
        block = self.prefix_cache.block
        if self.prefix_cache.capacity and end % block == 0 and end < len(live.feed):
            key = dict(boundary_hashes(live.feed[:end], block))[end]
            self.prefix_cache.insert(key, self.pool.export(slot, self.device))

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> None:
        """logits (B, V) → one new token per row; emits outputs and retires finished rows."""
        params = [row.live.request.params for row in rows]
        bp = BatchParams.from_params(params, self.device)
        processed = logits
        if bp.any_penalty:
            counts, seen = zip(*(row.penalty_counts(self.vocab_size, self.device) for row in rows))
            processed = apply_penalties(logits, torch.stack(counts), torch.stack(seen), bp)  # (B, V)
        uniforms = torch.tensor([row.uniform() for row in rows], device=self.device)  # (B,)
        tokens = sample(processed, bp, uniforms)  # (B,)
        logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
        now = time.monotonic()
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs):
            output = row.accept(token, logprob, now, self.eos_id)
            if output.finished:  # stats first: whoever sees the last output also sees its metrics
                self._retire_row(row, output.finish_reason)
            self._emit(row.live, output)

    def _retire_row(self, row: Row, reason: FinishReason) -> None:
        live = row.live
        if not self.scheduler.finish_row(live.request.request_id, row.slot):
            return
        self._finish_live(live, reason)

    def _finish_live(self, live: LiveRequest, reason: FinishReason) -> None:
        del self.live[live.request.request_id]
        if live.session is not None:
            self.sessions.commit(live.session, live)
        self.stats_sink(live.request_stats(reason, time.monotonic()))

    def _abort(self, request_id: str) -> None:
        live = self.live.get(request_id)
        if live is None:
            return
        self.scheduler.remove(request_id)
        if live.rows:
            outputs = [row.abort_output() for row in live.rows if not row.finished]
        else:  # still waiting: every one of its n sequences ends
            outputs = [live.abort_output(index) for index in range(live.request.params.n)]
        self._finish_live(live, FinishReason.ABORT)
        for output in outputs:
            self._emit(live, output)

    def _abort_all(self) -> None:
        for request_id in list(self.live):
            self._abort(request_id)

