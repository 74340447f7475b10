"""The engine core: one thread owns the model, the state pool and every live request.

Callers (async handlers, tests, the CLI) talk to it only through `submit`, `abort` and `sessions` (the
session commands, sessions/service.py), which queue commands and return futures; outputs go to a
per-request sink callable, called on the engine thread. The loop, in `_run`:

    drain commands → housekeeping → schedule → step: decode (one token per running row), deliver,
                                                      prefill (a bounded token budget), deliver first tokens

so a long prompt never stalls running streams. The model work is the step runner's (step_runner.py); the
scheduler admits waiting requests into state slots (scheduler.py, calling `acquire`/`release` here); the
session registry keeps the sessions' tiers (sessions/registry.py); the store is only ever touched by the
store worker's thread (sessions/worker.py).

Faults: a step that raises fails the requests it touched (their streams end with finish reason `error`)
and the engine goes on; so does a request whose admission raises. Only repeated consecutive failures, or
an error outside a step (a bug in the engine's own bookkeeping), end the thread — and a dead engine says
so: `alive` turns False, every pending and later call fails with kind `dead`, every live request gets its
error output, and `on_death` callbacks run (the server turns /health to 503 and exits for a restart).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import torch

from linserve.model import numerics, projection
from linserve.model.interface import ServedModel, fixed_state, model_type
from linserve.model.loading import in_dtype
from linserve.model.vocabulary import checkpoint_vocab_size

from . import heap
from .accounting import check_request, pool_stats, slot_accounting
from .command_queue import ENGINE_DEAD, CommandQueue
from .compile.cuda_graphs import STEP_LOCK
from .constraint import GrammarRuntime
from .cpu_threads import apply_threads, weight_bytes
from .detokenize import ByteLevelDecoder
from .live import LiveRequest, Row
from .model_kind import model_parts
from .sampling import SlotSampling
from .scheduler import SchedSeq, Scheduler, StepPlan
from .sessions.records import Session
from .sessions.registry import SessionRegistry
from .sessions.service import SessionService
from .sessions.worker import StoreStep, StoreWorker
from .slots import EngineSlots
from .state_pool import states_within
from .step_runner import Delivery
from .types import (
    EngineConfig,
    EngineError,
    EngineFacts,
    EngineRequest,
    FinishReason,
    RecordSkipped,
    RequestOutput,
    SessionLoaded,
    StepStats,
    StoreStats,
)

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
StatsSink = Callable[[object], None]

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the device or model is taken to be broken: the engine dies
STEP_FAILED = "the engine failed while serving this request (see the server log)"


class Engine:
    def __init__(self, model: ServedModel, tokenizer, config: EngineConfig, device: torch.device,
                 stats_sink: StatsSink | None = None, dtype: torch.dtype | None = None,
                 draft_model: ServedModel | None = None, eos_token_ids: tuple[int, ...] = (),
                 checkpoint: str | None = None) -> None:
        """`model` serves every form — prefill, prompt scoring, decode steps, verification — with its weights in
        `dtype` (None: as they are; else a copy): one function for every token, so a token's logits and state
        never depend on which form computed it (docs/engine.md, "Same request, same tokens"). `draft_model`:
        speculative decoding's draft model (same tokenizer), if the server has one; `checkpoint`: the directory
        it was loaded from (what /v1/models names)."""
        self.checkpoint = checkpoint
        self.model = model = (in_dtype(model, dtype) if dtype else model).eval()  # (every use below: this copy)
        # before the model runs or a program is built (kernels bake the count in); large weights: every CPU
        self.threads = apply_threads(config.threads, config.prefill_threads, weight_bytes(model), config.adapt_threads,
                                     config.kernel_threads, config.kernel_pool)
        self.config, self.device = config, device
        # incremental detokenization: a byte-level BPE tokenizer's table of token bytes where it reproduces the
        # tokenizer's decoding, else the Rust tokenizer directly if there is one (two decode calls per token)
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.decoder = ByteLevelDecoder.of(backend) or backend
        self.tokenizer = tokenizer
        self._grammars: GrammarRuntime | None = None
        self._grammars_lock = threading.Lock()
        # end-of-text: the tokenizer's, and any other the checkpoint names (generation_config.json: several ids)
        self.eos_ids = frozenset(t for t in (tokenizer.eos_token_id, *eos_token_ids) if t is not None)
        self.vocab_size = model.config.vocab_size
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(self.eos_ids, default=None)
        self.stats_sink = stats_sink or (lambda stats: None)
        self.sampling = SlotSampling(config.num_slots, self.vocab_size, device)
        # the model's kind (a fixed-size state, or the softmax baseline's KV cache) brings its parts: model_kind.py
        self.parts = parts = model_parts(self.model, config, self.sampling, device, self.eos_ids, self.threads,
                                         draft_model)
        self.pool, self.runner, self.prefix_cache = parts.pool, parts.runner, parts.prefix_cache
        self.decode_step, self.speculative, self.speculation = parts.decode_step, parts.speculative, parts.speculation
        self.reserved_slots = min(max(config.reserved_slots, config.max_n, 1), config.num_slots)
        store = parts.store
        self.store_worker = StoreWorker(store, config.session_store_timeout_s, self._store_result) if store.keeps \
            else None
        host_sessions = states_within(config.max_host_sessions, config.host_sessions_mb, self.pool.slot_bytes)
        # a snapshot names the decode weights: they made its state's tokens
        self.registry = SessionRegistry(self.pool, self.model, host_sessions, config.session_ttl_s,
                                        self.reserved_slots, config.session_turns_kept, store, self.store_worker,
                                        parts.text_chars, int(config.session_responses_mb * 2**20))
        self.commands = CommandQueue()
        # entered around every step, made once (its making was ~40% of the ~6.7 µs a step the context cost, cold)
        self._inference = torch.inference_mode()
        self.sessions = SessionService(self.registry, self.store_worker, self.commands.call, self.commands.internal,
                                       self.pool.slot_bytes, self._skipped_record,
                                       lambda: self.stats_sink(SessionLoaded()))
        self.live: dict[str, LiveRequest] = {}
        self.slots = EngineSlots(self.live, self.registry, self.pool, self.sampling, self.prefix_cache,
                                 lambda: self.grammars, parts.preemptible)
        self.scheduler = Scheduler(self.slots, config.max_batch_tokens, config.max_prefill_chunk,
                                   config.max_prefill_while_decoding, config.scheduling_policy,
                                   config.priority_aging_s, self._prefill_call)
        self._preempted_seen = 0  # the scheduler's preemptions already reported in a step's stats
        self.speculating = 0  # live requests whose rows may speculate (none: a step plans no drafts at all)
        self._decode_plan: list | None = None  # the scheduler's decode list last step, and its rows
        self._decode_rows: list[Row] = []
        self.on_death: list[Callable[[BaseException], None]] = []
        self._skipped_logged: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="linserve-engine", daemon=True)

    # ---------------------------------------------------------------- public, any thread
    def start(self) -> Engine:
        self._thread.start()
        self.parts.start(self.config.speculative)
        return self

    @property
    def alive(self) -> bool:
        return self.commands.death is None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (finish reason `abort`), end the thread, flush the session store."""
        self.parts.close()
        if self._thread.is_alive():
            self.commands.stopping.set()  # from here on new requests are refused
            self.commands.wake()
            self._thread.join(timeout)
        if self.store_worker is not None:
            self.store_worker.close()  # every turn handed over is stored (or failed) before the process exits
        self.sessions.close()  # and settled

    def submit(self, request: EngineRequest, sink: Sink) -> Future:
        """Future resolves once the request is accepted, or raises EngineError (bad input, busy, full)."""
        if request.session_id is None:
            return self.commands.call(lambda: self._accept(request, sink))
        return self.sessions.command(lambda session: self._accept(request, sink, session), request.session_id,
                                     request.owner, claim=True)

    def abort(self, request_id: str) -> None:
        self.commands.post(lambda: self._end(request_id, FinishReason.ABORT))

    def counts(self) -> Future:
        """(running, waiting, live) — for tests and health checks."""
        return self.commands.call(lambda: (self.scheduler.num_running, self.scheduler.num_waiting, len(self.live)))

    def slot_accounting(self) -> Future:
        """Who holds which slot, taken on the engine thread (the balance every engine test asserts)."""
        return self.commands.call(self._slot_accounting)

    @property
    def grammars(self) -> GrammarRuntime:
        """Structured outputs' view of the tokenizer (built at first use: ~20 ms); compiles requests' grammars."""
        with self._grammars_lock:  # asked from request threads and the engine thread alike
            if self._grammars is None:
                self._grammars = GrammarRuntime(self.tokenizer, self.vocab_size)
        return self._grammars

    @functools.cached_property
    def facts(self) -> EngineFacts:
        model = self.model
        return EngineFacts(
            device=str(self.device), threads=self.threads.threads, cpu_threads=self.threads.describe(),
            weights_dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
            projections=projection.describe(), model_type=model_type(model.config),
            state_bytes=model.state_bytes() if fixed_state(model) else None, vocab_size=self.vocab_size,
            checkpoint_vocab_size=checkpoint_vocab_size(model), reserved_slots=self.reserved_slots,
            slot_bytes=self.pool.slot_bytes, pool_bytes=self.pool.bytes_total,
            decode_step=self.decode_step is not None, checkpoint=self.checkpoint)

    def describe_decode_step(self) -> dict | None:
        """The decode step's compile status (None: the softmax baseline has none), for /ready, /version, /metrics;
        under "prefill", the prefill program's when there is one (prefill_program.py); under "threads", the count
        each compiled program's bucket runs on, as its steps' timing chose it (thread_trial.py); under
        "cpu_contention", the counts in force and the CPUs other processes held (cpu_contention.py)."""
        if self.decode_step is None:
            return None
        prefill = self.parts.prefill_step
        counts = getattr(self.runner, "threads", None)
        trials = counts.trials if counts is not None else None
        contention = counts.describe() if counts is not None else None
        return {**self.decode_step.describe(), **({"prefill": prefill.describe()} if prefill is not None else {}),
                **({"threads": trials.describe()} if trials is not None else {}),
                **({"cpu_contention": contention} if contention is not None else {})}

    def _prefill_call(self) -> tuple[int, int]:
        """(T, rows) of one compiled prefill program call while its largest bucket is ready (the scheduler prices
        a prompt that fits one call as its share of it), else (0, 0)."""
        step = self.runner.prefill_step
        if step is None:
            return 0, 0
        rows = step.sizes[-1]
        return (step.kind.tokens, rows) if step.bucket_ready(rows) is not None else (0, 0)

    def store_status(self) -> dict | None:
        """The session store's health (None: no store), for /ready."""
        return None if self.store_worker is None else self.store_worker.status()

    # ---------------------------------------------------------------- the loop (engine thread)
    def _run(self) -> None:
        numerics.flush_subnormals()
        try:
            failures = 0
            while not self.commands.stopping.is_set():
                idle = not self.live
                if idle and self.runner.threads is not None:  # (what other processes do meanwhile: no measure)
                    self.runner.threads.waiting()
                if self.commands.drain(block=idle) or idle:  # idle: once a second, so gauges follow expiry
                    self._emit_pool_stats()                  # and the store's sweep with no request at all
                self.registry.expire()
                plan = self.scheduler.schedule()
                for seq_id, error in plan.failed:  # admission raised (e.g. a seed the generator rejects)
                    logger.error("request %s could not be admitted", seq_id, exc_info=error)
                    self._end(seq_id, FinishReason.ERROR, STEP_FAILED)
                if plan.empty:
                    if plan.failed:  # their outputs are out: the pool changed (and an engine core sends them now)
                        self._emit_pool_stats()
                    continue
                try:
                    with self._inference, STEP_LOCK:  # (compile=auto measures between steps)
                        self._step(plan)
                    failures = 0
                except Exception as error:  # noqa: BLE001 - fail what the step touched, keep serving
                    failures += 1
                    touched = sorted({seq_id for seq_id, _ in plan.decode} | {seq_id for seq_id, _, _ in plan.prefill})
                    logger.exception("engine step failed (%d in a row); failing requests %s", failures, touched)
                    for seq_id in touched:
                        self._end(seq_id, FinishReason.ERROR, STEP_FAILED)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        raise RuntimeError(f"{failures} consecutive engine steps failed") from error
            for request_id in list(self.live):
                self._end(request_id, FinishReason.ABORT)
            self.commands.mark_exited()
            self.commands.drain(block=False)  # late commands still get an answer (new requests: unavailable)
            self._emit_pool_stats()
        except BaseException as error:  # noqa: BLE001 - the thread is ending: say so everywhere
            self._die(error)

    def _step(self, plan: StepPlan) -> None:
        """decode → deliver, then prefill → deliver the first tokens of the prompts it completed."""
        started, latencies, program_s, decoded, drafted, accepted = time.perf_counter(), [], 0.0, 0, 0, 0
        if plan.decode:
            if plan.decode is not self._decode_plan:  # (the scheduler's list stays the same while no row changes)
                self._decode_rows = [self.live[seq_id].row_for_slot(slot) for seq_id, slot in plan.decode]
                self._decode_plan = plan.decode
            rows = self._decode_rows
            # no speculation in a step that also prefills: a longer step would delay every prompt in it
            delivery = self.runner.decode(rows, speculate=self.speculating > 0 and not plan.prefill)
            program_s, decoded = delivery.program_s, delivery.tokens
            drafted, accepted = delivery.drafted, delivery.accepted
            self._deliver(delivery, latencies)
        if plan.prefill:
            self.runner.prefill([(self.live[seq_id], start, length) for seq_id, start, length in plan.prefill])
            done = [self.live[seq_id] for seq_id, _, length in plan.prefill if self.scheduler.prefilled(seq_id, length)]
            self._deliver(self.runner.first_tokens(done), latencies)
        phase = "mixed" if plan.decode and plan.prefill else ("decode" if plan.decode else "prefill")
        self.stats_sink(StepStats(duration_s=time.perf_counter() - started, phase=phase,
                                  batch_size=len(plan.decode), decode_tokens=decoded, drafted=drafted,
                                  accepted=accepted, prefill_tokens=plan.prefill_tokens,
                                  token_latencies=tuple(latencies),
                                  program_s=program_s, preempted=self.scheduler.preemptions - self._preempted_seen))
        self._preempted_seen = self.scheduler.preemptions
        self._emit_pool_stats()

    def _deliver(self, delivery: Delivery, latencies: list) -> None:
        """Hand out a phase's outputs in order (stats first: a finished row retires before its last output
        goes out, so whoever sees it also sees its metrics), then fail the requests it could not serve."""
        latencies += delivery.latencies
        for row, output in delivery.outputs:
            if output.finish_reason is not None:
                self._retire_row(row, output.finish_reason)
            self._emit(row.live, output)
        for request_id, why in delivery.failed:
            self._end(request_id, FinishReason.ERROR, why)

    # ---------------------------------------------------------------- admission
    def _accept(self, request: EngineRequest, sink: Sink, session: Session | None = None) -> None:
        if self.commands.stopping.is_set():
            raise EngineError("the engine is shutting down", kind="unavailable")
        if request.request_id in self.live:
            raise EngineError(f"duplicate request id {request.request_id}")
        params = request.params
        # what could never be served is a 400 whether the queue is full or not (a 429 would ask for a useless retry)
        check_request(request, self.config, self.reserved_slots, self.vocab_size)
        self.parts.admit(params)  # a draft model it lacks: 400; else its programs get compiled
        feed = list(request.prompt_ids)
        if session is not None:  # found (404) and claimed (409) before anything about the body
            if params.n != 1:
                raise EngineError("n must be 1 when continuing a session", param="n")
            self.registry.acquire_for_request(session, len(feed) + params.max_tokens + 1, request.idempotency,
                                              request.expected_revision)
            feed = session.pending + feed
            if not feed and session.logits is None:  # a new, empty session: start from end-of-text, as
                if self.eos_id is None:              # a stateless request with an empty prompt does
                    self.registry.release(session)
                    raise EngineError("the session is empty: send a prompt", param="prompt")
                request = replace(request, prompt_ids=[self.eos_id])
                feed = [self.eos_id]
        elif not feed:
            raise EngineError("the prompt is empty", param="prompt")
        try:
            self.parts.check_context(len(feed), params.max_tokens)  # the softmax baseline's KV cache must hold it
            if len(self.scheduler.waiting) >= self.config.max_waiting:
                raise EngineError("the request queue is full", kind="capacity")
        except EngineError:
            if session is not None:  # (claimed above: free again for the retry)
                self.registry.release(session)
            raise
        live = LiveRequest(request=request, sink=sink, feed=feed, session=session, decoder=self.decoder,
                           eos_ids=self.eos_ids, arrival=time.monotonic(),
                           text_chars=self.registry.text_chars if session is not None else 0)
        if self.speculation is not None and self.speculation.method(params)[0] != "off":
            live.speculates = True
            self.speculating += 1
        self.live[request.request_id] = live
        self.scheduler.add(SchedSeq(request.request_id, to_prefill=len(feed), rows=params.n,
                                    priority=params.priority))

    # ---------------------------------------------------------------- ends of a request
    def _retire_row(self, row: Row, reason: FinishReason) -> None:
        if self.scheduler.finish_row(row.live.request.request_id, row.slot):
            self._finish_live(row.live, reason)

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """End a request early (abort, failure): every sequence gets its last output."""
        live = self.live.get(request_id)
        if live is None:
            return
        self.scheduler.remove(request_id)
        outputs = live.final_outputs(reason, error)
        self._finish_live(live, reason)
        for output in outputs:
            self._emit(live, output)

    def _finish_live(self, live: LiveRequest, reason: FinishReason) -> None:
        del self.live[live.request.request_id]
        self.speculating -= live.speculates
        if live.session is not None:
            step = self.registry.commit(live.session, live.turn_result(self.sampling))
            if step is not None:  # its final outputs are held until the turn is stored
                live.held = []
                settle = lambda error, result: self._settle_turn(live, step, error, result)  # noqa: E731
                self.sessions.run_store_step(replace(step, settle=settle))
        self.stats_sink(live.request_stats(reason, time.monotonic()))
        if len(live.feed) >= heap.LARGE_TOKENS:
            live.feed = []
            heap.trim()  # the prompt's token lists are garbage now: return their heap to the OS

    def _settle_turn(self, live: LiveRequest, step: StoreStep, error: BaseException | None, result: object) -> None:
        """The turn's record is written (its held outputs go out) or not (the session rolls back to its last
        stored turn and the request fails with the store's 503)."""
        held, live.held = live.held, None
        try:
            step.settle(error, result)
        except EngineError as failure:
            held = [replace(output, token_id=None, text="", logprob=None, finish_reason=FinishReason.ERROR,
                            error=failure.message, error_kind=failure.kind) for output in held]
        for output in held:
            self._emit(live, output)

    def _emit(self, live: LiveRequest, output: RequestOutput) -> None:
        if output.finish_reason is not None and live.held is not None:  # a session turn's end waits for its write
            live.held.append(output)
            return
        try:
            live.sink(output)
        except Exception:  # noqa: BLE001 - a broken sink must not take the engine down
            logger.exception("output sink of %s failed; aborting it", live.request.request_id)
            self.abort(live.request.request_id)

    def _die(self, error: BaseException) -> None:
        logger.critical("the engine thread died: %r", error, exc_info=error)
        self.commands.die(error)
        for live in list(self.live.values()):
            for output in live.final_outputs(FinishReason.ERROR, ENGINE_DEAD):
                try:
                    live.sink(output)
                except Exception:  # noqa: BLE001 - best effort: the engine is gone
                    logger.exception("output sink failed while the engine was dying")
        self.live.clear()
        self.speculating = 0
        for callback in self.on_death:
            try:
                callback(error)
            except Exception:  # noqa: BLE001
                logger.exception("on_death callback failed")

    # ---------------------------------------------------------------- observations
    def describe_speculation(self) -> dict | None:
        """For /ready (speculation.SpeculativeDecoding.describe); None for a softmax model."""
        return self.parts.describe_speculation()

    def _emit_pool_stats(self) -> None:
        self.stats_sink(pool_stats(self.pool, self.registry, self.scheduler))

    def _slot_accounting(self) -> dict[str, int]:
        return {**slot_accounting(self.pool, self.registry, self.scheduler, self.live),
                "speculating": self.speculating,  # the count the step reads, and a recount
                "counted_speculating": sum(live.speculates for live in self.live.values())}

    def _store_result(self, op: str, result: str, seconds: float) -> None:
        worker = getattr(self, "store_worker", None)  # (a probe may report before the constructor has finished)
        self.stats_sink(StoreStats(op, result, seconds, worker.up if worker is not None else result == "ok"))

    def _skipped_record(self, session_id: str, reason: str) -> None:
        """A broken record met by a listing (store thread): counted every time, logged once per record."""
        self.stats_sink(RecordSkipped())
        if session_id not in self._skipped_logged and len(self._skipped_logged) < 10_000:
            self._skipped_logged.add(session_id)
            logger.warning("session store record %s is unreadable (%s): skipped", session_id, reason)
