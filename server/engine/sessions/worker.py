"""The one thread that talks to the session store: every store call runs here, in the order submitted,
each with a deadline — never on the engine thread, so a slow, frozen or dead store costs stateless streams
nothing, and session work fails on its own clock.

`submit(op, fn, timeout_s)` returns a future. `fn(deadline)` gets the deadline as a unix time and passes it
to the store, which takes effect before it or not at all (see session_store). A job still queued when its
deadline passes fails without touching the store; a job that hangs inside the store past its deadline (a
filesystem that never answers) is failed by the watchdog, and the jobs behind it expire on their own
deadlines. Results are counted by kind (`on_result(op, result, seconds)`); `up` is the store's health:
down after a failed or late call, up again after a successful call or probe (the idle thread probes the
store every PROBE_INTERVAL_S, more often while it is down).

Health has a hysteresis, as a load balancer's checks do: the store goes down after FALL consecutive failed
calls (a failure makes the idle thread probe at once, so an outage is noticed within a second) and comes back
after RISE consecutive successes; interleaved failures and successes flip nothing. The log has one line per
change (down / back, with what happened in between) and, while anything fails, a summary every
SUMMARY_INTERVAL_S — never a line per failed call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from ..cpu_threads import one_thread_here
from ..types import EngineError
from .stores import OutcomeUnknown, SessionStore, StoreTimeout, StoreUnavailable

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 10.0  # while up and idle
PROBE_INTERVAL_DOWN_S = 0.5  # while down (or after a failure): notice the store's return quickly
WATCHDOG_GRACE_S = 0.25  # past its deadline, a hung call's caller is told it failed
WRITES = frozenset({"put", "delete"})  # a write hung past its deadline may still land: its outcome is unknown
FALL = 2  # consecutive failed calls that make the store down
RISE = 2  # consecutive successful calls (or probes) that bring it back
SUMMARY_INTERVAL_S = 60.0  # while calls fail: one summary line per interval


def error_kind(error: BaseException) -> str:
    """A bounded label for a store failure (the `result` of linserve_session_store_operations_total)."""
    if isinstance(error, (StoreTimeout, TimeoutError, OutcomeUnknown)) or type(error).__name__ == "TimeoutError":
        return "timeout"
    if isinstance(error, StoreUnavailable) or isinstance(error, (FileNotFoundError, NotADirectoryError)):
        return "missing"
    if isinstance(error, PermissionError):
        return "permission"
    if isinstance(error, ConnectionError) or type(error).__name__ == "ConnectionError":
        return "connection"
    if isinstance(error, OSError):
        return "io"
    return "error"


@dataclass
class _Job:
    op: str
    fn: Callable[[float | None], object]
    future: Future
    deadline: float | None  # time.monotonic(); None: no deadline (background upkeep)
    started: float | None = None
    timed_out: bool = field(default=False)


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> bool:
    """Resolve the future unless the watchdog already did (a hung call that came back too late)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
        return True
    except InvalidStateError:
        return False


class StoreWorker:
    def __init__(self, store: SessionStore, timeout_s: float,
                 on_result: Callable[[str, str, float], None] | None = None) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.on_result = on_result or (lambda op, result, seconds: None)
        self.up = True
        self.last_error: str | None = None
        self.summary_interval_s = SUMMARY_INTERVAL_S
        self._streak = 0  # consecutive results against the current state (failures while up, successes while down)
        self._changed = time.monotonic()  # when `up` last changed
        self._failed: dict[str, int] = {}  # failed calls by kind since the last summary or change
        self._calls = 0  # calls since the last summary or change
        self._summarized = time.monotonic()
        self._last_detail = ""
        self._health_lock = threading.Lock()
        self.after_probe: list[Callable[[float | None], None]] = []  # store thread, after each successful probe
        self._last_upkeep = time.monotonic()
        self._jobs: deque[_Job] = deque()
        self._running: _Job | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._last_activity = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="linserve-session-store", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="linserve-store-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    # ---------------------------------------------------------------- any thread
    def submit(self, op: str, fn: Callable[[float | None], object], timeout_s: float | None = -1.0) -> Future:
        """Run `fn(deadline)` on the store thread after everything submitted before; `timeout_s` -1: the
        store timeout, None: no deadline (background upkeep that no caller waits for)."""
        timeout = self.timeout_s if timeout_s == -1.0 else timeout_s
        future: Future = Future()
        job = _Job(op, fn, future, None if timeout is None else time.monotonic() + timeout)
        with self._cond:
            if self._closed:
                future.set_exception(StoreUnavailable("the session store is closed"))
                return future
            self._jobs.append(job)
            self._cond.notify_all()
        return future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far has run (True) or `timeout` passes (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._running is not None:
                remaining = None if end is None else end - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining if remaining is not None else 0.5)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Run what is queued (each job within its own deadline), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5)

    def status(self) -> dict:
        return {"kind": self.store.kind, "up": self.up, "last_error": self.last_error}

    # ---------------------------------------------------------------- the store thread
    def _run(self) -> None:
        one_thread_here()  # (the engine's OpenMP team stays the only one: cpu_threads.py)
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    if not self._cond.wait(self._probe_wait()):
                        break
                if not self._jobs:
                    if self._closed:
                        return
                    job = _Job("ping", self._probe, Future(), time.monotonic() + self.timeout_s)
                else:
                    job = self._jobs.popleft()
                if job.deadline is not None and time.monotonic() > job.deadline:  # expired in the queue
                    _settle(job.future, error=StoreTimeout(f"the session store did not answer within "
                                                           f"{self.timeout_s:g} s"))
                    self._record(job, "timeout", 0.0, "queued past its deadline")
                    self._cond.notify_all()
                    continue
                job.started = time.monotonic()
                self._running = job
            self._execute(job)
            with self._cond:
                self._running = None
                self._last_activity = time.monotonic()
                self._cond.notify_all()

    def _probe(self, deadline: float | None) -> None:
        self.store.ping()
        self._upkeep(deadline)

    def _upkeep(self, deadline: float | None) -> None:
        """What waits for the store to answer (leases whose release it missed): after every successful probe,
        and at most once per PROBE_INTERVAL_DOWN_S after a successful call (a busy worker never probes)."""
        self._last_upkeep = time.monotonic()
        for upkeep in self.after_probe:
            try:
                upkeep(deadline)
            except Exception:  # noqa: BLE001 - upkeep retries by itself; it never fails the job it follows
                logger.exception("session store upkeep failed")

    def _execute(self, job: _Job) -> None:
        wall_deadline = None if job.deadline is None else time.time() + (job.deadline - time.monotonic())
        try:
            result = job.fn(wall_deadline)
        except EngineError as answer:  # the store answered (e.g. the lease is held elsewhere): not a failure
            if _settle(job.future, error=answer):
                self._record(job, "ok", time.monotonic() - job.started)
            return
        except Exception as error:  # noqa: BLE001 - the caller gets it; serving goes on
            late = not _settle(job.future, error=error)
            self._record(job, error_kind(error), time.monotonic() - job.started,
                         f"{type(error).__name__}: {error}" + (" (after its caller was told)" if late else ""))
            return
        if _settle(job.future, result):
            self._record(job, "ok", time.monotonic() - job.started)
            if job.op != "ping" and time.monotonic() - self._last_upkeep >= PROBE_INTERVAL_DOWN_S:
                self._upkeep(wall_deadline)

    def _record(self, job: _Job, result: str, seconds: float, detail: str | None = None) -> None:
        with self._health_lock:  # the store thread and the watchdog both report
            self._judge(job, result, detail)
        self.on_result(job.op, result, seconds)

    def _judge(self, job: _Job, result: str, detail: str | None) -> None:
        ok = result == "ok"
        self._calls += 1
        if not ok:
            self._failed[result] = self._failed.get(result, 0) + 1
            self.last_error = f"{job.op}: {result}"  # what /ready and a 503 say (no paths or hosts)
            self._last_detail = f"{self.last_error}, {detail}" if detail else self.last_error
        elif self.up:
            self.last_error = None
        self._streak = 0 if ok == self.up else self._streak + 1
        now = time.monotonic()
        if self.up and self._streak >= FALL:
            logger.error("the session store is down after %d failed calls in a row (last: %s)", FALL, self._last_detail)
            self._change(False, now)
        elif not self.up and self._streak >= RISE:
            logger.warning("the session store is back after %.1f s down (%s)", now - self._changed, self._tally())
            self.last_error = None
            self._change(True, now)
        elif self._failed and now - self._summarized >= self.summary_interval_s:
            logger.warning("the session store is %s: %s in the last %.1f s (last: %s)",
                           "up" if self.up else f"still down ({now - self._changed:.0f} s)", self._tally(),
                           now - self._summarized, self._last_detail)
            self._reset_tally(now)

    def _change(self, up: bool, now: float) -> None:
        self.up, self._streak, self._changed = up, 0, now
        self._reset_tally(now)

    def _tally(self) -> str:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(self._failed.items()))
        return f"{sum(self._failed.values())} of {self._calls} calls failed" + (f" ({kinds})" if kinds else "")

    def _reset_tally(self, now: float) -> None:
        self._failed, self._calls, self._summarized = {}, 0, now

    def _probe_wait(self) -> float:
        interval = PROBE_INTERVAL_S if self.up and not self._streak else PROBE_INTERVAL_DOWN_S
        return max(0.05, self._last_activity + interval - time.monotonic())

    def _watch(self) -> None:
        """Fail a call that hangs past its deadline (its caller is answered; the thread stays stuck in it
        until the store returns, and the jobs behind it expire on their deadlines)."""
        while True:
            time.sleep(0.1)
            with self._cond:
                if self._closed and not self._thread.is_alive():
                    return
                job = self._running
                now = time.monotonic()
                hung = (job is not None and job.deadline is not None and not job.timed_out
                        and now > job.deadline + WATCHDOG_GRACE_S)
                expired = [j for j in self._jobs if j.deadline is not None and now > j.deadline + WATCHDOG_GRACE_S
                           and not j.future.done()]
            if hung:
                job.timed_out = True
                failure = (OutcomeUnknown("the session store took the write and did not answer in time")
                           if job.op in WRITES else StoreTimeout("the session store is not answering"))
                if _settle(job.future, error=failure):
                    self._record(job, "timeout", now - job.started, "hung past its deadline")
            for queued in expired:  # behind a hung call: answered now, skipped when reached
                _settle(queued.future, error=StoreTimeout("the session store is not answering"))


@dataclass(frozen=True)
class StoreStep:
    """What a session command leaves for the store: `run(deadline)` on the store thread, then `settle(error,
    result)` on the engine thread (None: `run`'s result is the answer). A command is answered only after
    its settle: 2xx means stored."""

    op: str
    run: Callable[[float | None], object]
    settle: Callable[[BaseException | None, object], object] | None = None
