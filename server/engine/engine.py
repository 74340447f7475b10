"""The engine: one thread owns the model, the state pool and every live request.

Callers (async handlers, tests, the CLI) talk to it only through `submit`, `abort` and the session
methods (`session_commands.py`), which enqueue commands and return futures; outputs go to a per-request sink callable, called
on the engine thread. Each step decodes one token for every running row and spends the rest of a token
budget on chunked prefill, so a long prompt never stalls running streams.

Faults: a step that raises fails the requests it touched (their streams end with finish reason `error`)
and the engine goes on; so does a request whose admission raises. Only repeated consecutive failures, or
an error outside a step (a bug in the engine's own bookkeeping), end the thread — and a dead engine says
so: `alive` turns False, every pending and later call fails with kind `dead`, every live request gets its
error output, and `on_death` callbacks run (the server turns /health to 503 and exits for a restart).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from model import LinearGPT

from . import heap
from .compiled_decode import TRACING, DecodeStep
from .kv_pool import KVCachePool
from .live import LiveRequest
from .prefix_cache import PrefixCache, scope_seed
from .scheduler import SchedSeq, Scheduler
from .session_commands import SessionCommands
from .session_manager import SessionManager
from .sessions import Session
from .state_pool import StatePool
from .steps import StepExecution
from .session_store import open_store
from .store_worker import StoreWorker
from .types import (EngineError, EngineRequest, FinishReason, PoolStats, RecordSkipped, RequestOutput,
                    StoreStats)

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
StatsSink = Callable[[object], None]
Command = tuple[Callable[[], object], "Future | None"]

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the device or model is taken to be broken: the engine dies
STEP_FAILED = "the engine failed while serving this request (see the server log)"
ENGINE_DEAD = "the engine has stopped after an internal error; the server is restarting"


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
    # slots idle sessions can never pin: stateless work always finds room (at least max_n of them)
    reserved_slots: int = 8
    session_turns_kept: int = 8  # turn snapshots per session, for rewind (each one state's bytes)
    session_store: str = "none"  # "none", "dir:PATH" or "redis://HOST:PORT/DB": the tier below host memory
    session_store_timeout_s: float = 2.0  # deadline of every store call; a later one fails (503), taking no effect
    compile: str = "off"  # the decode step: "off" (eager), "on" or "auto" (see compiled_decode)
    compile_cache_dir: str | None = None  # Inductor's on-disk caches (None: torch's default place)


class Engine(StepExecution, SessionCommands):
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
        max_rows = min(config.num_slots, config.max_batch_tokens)
        self.decode_step = DecodeStep(model, self.pool, device, config.compile, max_rows,
                                      config.compile_cache_dir) if self.linear else None
        cache_entries = config.prefix_cache_entries if self.linear else 0
        self.prefix_cache = PrefixCache(cache_entries, config.max_prefill_chunk, self.pool.slot_bytes)
        self.reserved_slots = min(max(config.reserved_slots, config.max_n, 1), config.num_slots)
        self.stats_sink = stats_sink or (lambda stats: None)
        store = (open_store(config.session_store, config.session_ttl_s, config.session_store_timeout_s)
                 if self.linear else None)
        self.store_worker = None if store is None else StoreWorker(store, config.session_store_timeout_s,
                                                                   self._store_result)
        self.sessions = SessionManager(self.pool, model, config.max_host_sessions, config.session_ttl_s,
                                       self.reserved_slots, config.session_turns_kept, store, self.store_worker)
        self._skipped_logged: set[str] = set()
        self.scheduler = Scheduler(self, config.max_batch_tokens, config.max_prefill_chunk,
                                   config.max_prefill_while_decoding)
        self.live: dict[str, LiveRequest] = {}
        self._commands: queue.Queue[Command] = queue.Queue()
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # orders enqueueing against death
        self._exited = False  # the thread has left its loop: internal calls run on the caller's thread
        self.death: BaseException | None = None
        self.on_death: list[Callable[[BaseException], None]] = []
        self._thread = threading.Thread(target=self._run, name="linserve-engine", daemon=True)

    # ---------------------------------------------------------------- public, any thread
    def start(self) -> Engine:
        self._thread.start()
        if self.decode_step is not None:
            self.decode_step.start()  # compiles in the background; eager serves meanwhile
        return self

    @property
    def alive(self) -> bool:
        return self.death is None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (finish reason `abort`), end the thread, flush the session store."""
        if self.decode_step is not None:
            self.decode_step.close()
        if self._thread.is_alive():
            self._stopping.set()  # from here on new requests are refused
            self._commands.put((lambda: None, None))  # wake the loop
            self._thread.join(timeout)
        if self.store_worker is not None:
            self.store_worker.close()  # every turn handed over is stored (or failed) before the process exits

    def submit(self, request: EngineRequest, sink: Sink) -> Future:
        """Future resolves once the request is accepted, or raises EngineError (bad input, busy, full)."""
        if request.session_id is None:
            return self._call(lambda: self._accept(request, sink))
        return self._session_command(lambda session: self._accept(request, sink, session), request.session_id,
                                     request.owner, claim=True)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.death is None:
                self._commands.put((lambda: self._abort(request_id), None))

    def counts(self) -> Future:
        """(running, waiting, live) — for tests and health checks."""
        return self._call(lambda: (self.scheduler.num_running, self.scheduler.num_waiting, len(self.live)))

    def slot_accounting(self) -> Future:
        """Who holds which slot, taken on the engine thread (the balance every engine test asserts)."""
        return self._call(self._slot_accounting)

    def store_status(self) -> dict | None:
        """The session store's health (None: no store), for /ready."""
        return None if self.store_worker is None else self.store_worker.status()

    # ---------------------------------------------------------------- engine thread
    def _internal_call(self, fn: Callable[[], object]) -> Future:
        """`_call` for the engine's own follow-ups (a store write settling): taken while stopping too, and
        run on the caller's thread once the engine thread has ended (nothing races with it then)."""
        future: Future = Future()
        with self._lock:
            if self.death is None and not self._exited:
                self._commands.put((fn, future))
                return future
        self._run_command(fn, future)
        return future

    def _call(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self._lock:
            if self.death is not None:
                future.set_exception(EngineError(ENGINE_DEAD, kind="dead"))
            elif self._stopping.is_set():
                future.set_exception(EngineError("the engine is shutting down", kind="unavailable"))
            else:
                self._commands.put((fn, future))
        return future

    def _run(self) -> None:
        try:
            failures = 0
            while not self._stopping.is_set():
                self._drain_commands(block=not self.live)
                self.sessions.expire()
                plan = self.scheduler.schedule()
                for seq_id, error in plan.failed:  # admission raised (e.g. a seed the generator rejects)
                    self._request_failed(seq_id, error)
                if plan.empty:
                    continue
                try:
                    with torch.inference_mode(), TRACING:  # never inside a compile's trace window
                        self._step(plan)
                    failures = 0
                except Exception as error:  # noqa: BLE001 - fail what the step touched, keep serving
                    failures += 1
                    touched = {seq_id for seq_id, _ in plan.decode} | {seq_id for seq_id, _, _ in plan.prefill}
                    logger.exception("engine step failed (%d in a row); failing requests %s", failures, sorted(touched))
                    for seq_id in touched:
                        self._fail_request(seq_id, STEP_FAILED)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise RuntimeError(f"{failures} consecutive engine steps failed") from error
            self._abort_all()
            with self._lock:
                self._exited = True
            self._drain_commands(block=False)  # late commands still get an answer (new requests: unavailable)
            self._emit_pool_stats()
        except BaseException as error:  # noqa: BLE001 - the thread is ending: say so everywhere
            self._die(error)

    def _die(self, error: BaseException) -> None:
        logger.critical("the engine thread died: %r", error, exc_info=error)
        with self._lock:
            self.death = error
            pending = []
            while not self._commands.empty():
                pending.append(self._commands.get_nowait())
        for _, future in pending:
            if future is not None:
                future.set_exception(EngineError(ENGINE_DEAD, kind="dead"))
        for live in list(self.live.values()):
            for output in live.final_outputs(FinishReason.ERROR, ENGINE_DEAD):
                try:
                    live.sink(output)
                except Exception:  # noqa: BLE001 - best effort: the engine is gone
                    logger.exception("output sink failed while the engine was dying")
        self.live.clear()
        for callback in self.on_death:
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("on_death callback failed")

    def _drain_commands(self, block: bool) -> None:
        """Run queued commands; when idle, wait (up to a second, for housekeeping) for the first one."""
        try:
            command = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                self._emit_pool_stats()
                return

    @staticmethod
    def _run_command(fn: Callable[[], object], future: Future | None) -> None:
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001 - delivered to the caller (or logged: aborts have none)
            if future is None:
                logger.exception("engine command failed")
            else:
                future.set_exception(error)
            return
        if future is not None:
            future.set_result(result)

    def _emit(self, live: LiveRequest, output: RequestOutput) -> None:
        if output.finished and live.held is not None:  # a session turn's end waits for its store write
            live.held.append(output)
            return
        try:
            live.sink(output)
        except Exception:  # noqa: BLE001 - a broken sink must not take the engine down
            logger.exception("output sink of %s failed; aborting it", live.request.request_id)
            self._commands.put((lambda: self._abort(live.request.request_id), None))

    def _accept(self, request: EngineRequest, sink: Sink, session: Session | None = None) -> None:
        if self._stopping.is_set():
            raise EngineError("the engine is shutting down", kind="unavailable")
        if request.request_id in self.live:
            raise EngineError(f"duplicate request id {request.request_id}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineError("the request queue is full", kind="capacity")
        params = request.params
        if params.n > self.config.max_n:
            raise EngineError(f"n must be <= {self.config.max_n}", param="n")
        if params.n > self.reserved_slots:
            raise EngineError(f"n must be <= {self.reserved_slots} on this server (state slots)", param="n")
        if params.top_k > self.vocab_size:
            raise EngineError(f"top_k must be <= the vocabulary size {self.vocab_size} (0 disables it)", param="top_k")
        if any(not 0 <= t < self.vocab_size for t in request.prompt_ids):
            raise EngineError("prompt holds token ids outside the vocabulary", param="prompt")
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias):
            raise EngineError(f"logit_bias names token ids outside the vocabulary (0..{self.vocab_size - 1})",
                              param="logit_bias")
        feed = list(request.prompt_ids)
        if session is not None:  # found (404) and claimed (409) before anything about the body
            if params.n != 1:
                raise EngineError("n must be 1 when continuing a session", param="n")
            self.sessions.acquire_for_request(session, len(feed) + params.max_tokens + 1)
            feed = session.pending + feed
            if not feed and session.logits is None:  # a new, empty session: start from end-of-text, as
                if self.eos_id is None:              # a stateless request with an empty prompt does
                    self.sessions.release(session)
                    raise EngineError("the session is empty: send a prompt", param="prompt")
                request = replace(request, prompt_ids=[self.eos_id])
                feed = [self.eos_id]
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
        """Slots for seq, or None to wait; if this raises, nothing it took stays taken."""
        live = self.live[seq.seq_id]
        now = time.monotonic()
        if live.session is not None:
            slot = self.sessions.bring_to_device(live.session)
            if slot is not None:
                live.assign_slots([slot], now, self.vocab_size, self.device)
            return None if slot is None else [slot]
        slots: list[int] = []
        try:
            for _ in range(seq.rows):
                slot = self.sessions.allocate_slot()
                if slot is None:
                    for taken in slots:
                        self.pool.free(taken)
                    return None
                slots.append(slot)
            live.prefix_digest = scope_seed(live.request.owner)
            hit_len, live.prefix_digest, entry = self.prefix_cache.lookup(live.feed, live.prefix_digest)
            live.prefix_hit = entry is not None
            if entry is not None:
                self.pool.load(slots[0], entry)
                seq.prefilled = live.consumed = hit_len
            live.assign_slots(slots, now, self.vocab_size, self.device)
        except BaseException:
            for taken in slots:
                self.pool.free(taken)
            live.rows.clear()
            raise
        return slots

    def release(self, seq: SchedSeq, slots: list[int]) -> None:
        live = self.live.get(seq.seq_id)
        for slot in slots:
            if live is None or live.session is None or slot != live.session.slot:
                self.pool.free(slot)

    def _emit_pool_stats(self) -> None:
        tiers = self.sessions.tier_counts()
        self.stats_sink(PoolStats(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting, slots_in_use=self.pool.used_slots,
            slots_total=self.pool.num_slots, state_bytes_in_use=self.pool.bytes_in_use,
            sessions_device=tiers["device"], sessions_host=tiers["host"], sessions_store=self.sessions.stored,
        ))

    def _slot_accounting(self) -> dict[str, int]:
        session_slots = [s.slot for s in self.sessions.sessions.values() if s.slot is not None]
        seq_slots = [slot for seq in self.scheduler.active.values() for slot in seq.slots]
        row_only = set(seq_slots) - set(session_slots)
        return {"slots_in_use": self.pool.used_slots, "running_rows": len(row_only),
                "device_sessions": len(session_slots), "distinct_session_slots": len(set(session_slots)),
                "distinct_row_slots": len(set(seq_slots)), "row_slots": len(seq_slots),
                "free_list": self.pool.free_slots, "distinct_free": self.pool.distinct_free_slots,
                "num_slots": self.pool.num_slots, "bytes_in_use": self.pool.bytes_in_use,
                "slot_bytes": self.pool.slot_bytes, "live": len(self.live)}

    # ---- ends of a request ----
    def _finish_live(self, live: LiveRequest, reason: FinishReason) -> None:
        del self.live[live.request.request_id]
        if live.session is not None:
            step = self.sessions.commit(live.session, live)
            if step is not None:  # its final outputs are held until the turn is stored
                live.held = []
                self._run_store_step(replace(step, settle=lambda error, _: self._settle_turn(live, step, error)))
        self.stats_sink(live.request_stats(reason, time.monotonic()))
        if len(live.feed) >= heap.LARGE_TOKENS:
            live.feed = []
            heap.trim()  # the prompt's token lists are garbage now: return their heap to the OS

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        live = self.live.get(request_id)
        if live is None:
            return
        self.scheduler.remove(request_id)
        outputs = live.final_outputs(reason, error)
        self._finish_live(live, reason)
        for output in outputs:
            self._emit(live, output)

    def _settle_turn(self, live: LiveRequest, step, error: BaseException | None) -> None:
        """The turn's record is written (its held outputs go out) or not (the session rolls back to its last
        stored turn and the request fails with the store's 503)."""
        held, live.held = live.held, None
        try:
            step.settle(error, None)
        except EngineError as failure:
            held = [replace(output, token_id=None, text="", logprob=None, finish_reason=FinishReason.ERROR,
                            error=failure.message, error_kind=failure.kind) for output in held]
        for output in held:
            self._emit(live, output)

    def _store_result(self, op: str, result: str, seconds: float) -> None:
        worker = getattr(self, "store_worker", None)  # (a probe may report before the constructor has finished)
        self.stats_sink(StoreStats(op, result, seconds, worker.up if worker is not None else result == "ok"))

    def _skipped_record(self, session_id: str, reason: str) -> None:
        """A broken record met by a listing (store thread): counted every time, logged once per record."""
        self.stats_sink(RecordSkipped())
        if session_id not in self._skipped_logged and len(self._skipped_logged) < 10_000:
            self._skipped_logged.add(session_id)
            logger.warning("session store record %s is unreadable (%s): skipped", session_id, reason)

    def _abort(self, request_id: str) -> None:
        self._end(request_id, FinishReason.ABORT)

    def _fail_request(self, request_id: str, message: str) -> None:
        self._end(request_id, FinishReason.ERROR, message)

    def _request_failed(self, request_id: str, error: Exception) -> None:
        logger.error("request %s could not be admitted", request_id, exc_info=error)
        self._fail_request(request_id, STEP_FAILED)

    def _abort_all(self) -> None:
        for request_id in list(self.live):
            self._abort(request_id)
