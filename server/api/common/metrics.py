"""Every Prometheus metric linserve exports, defined once, and the translation of engine stats into them.

No per-request or per-session labels. `linserve_inter_token_latency_seconds{context}` observes each
streamed token in the bucket of its position in its sequence: flat per-token latency shows up as the
same distribution in every context bucket.
"""

from __future__ import annotations

import bisect
import os
import threading
from typing import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  - re-exported for the /metrics route
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ...engine.proc_stat import stat_fields
from ...engine.types import PoolStats, RecordSkipped, RequestStats, SessionLoaded, StepStats, StoreStats

disable_created_metrics()  # no *_created series: plain classic text format

# fine below 10 ms (1 ms and 2 ms land in different buckets), then up to seconds
LATENCY_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                   0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
CONTEXT_BUCKETS = ((1024, "0-1k"), (4096, "1k-4k"), (16384, "4k-16k"), (65536, "16k-64k"))


class ContextLatencies:
    """`linserve_inter_token_latency_seconds{context}`: a histogram observed once per streamed token, so it takes
    a step's tokens in one call (`observe_step`: one lock, a bisect and two adds a token) where
    prometheus-client's Histogram takes a lock per bucket count and per sum, per token. Its exposition is that
    Histogram's: the same name, help, label, buckets (`le` as Go prints floats) and `_count`/`_sum`, every
    context's series present from the start."""

    name = "linserve_inter_token_latency_seconds"
    documentation = "Time between consecutive tokens of a sequence, by the token's position (context)."

    def __init__(self, buckets: tuple[float, ...], registry: CollectorRegistry) -> None:
        self.bounds = list(buckets)
        self.labels = [label for _, label in CONTEXT_BUCKETS] + ["64k+"]
        self.limits = [limit for limit, _ in CONTEXT_BUCKETS]
        self._counts = [[0] * (len(self.bounds) + 1) for _ in self.labels]  # per context: per bucket, +Inf last
        self._sums = [0.0] * len(self.labels)
        self._lock = threading.Lock()
        registry.register(self)

    def observe_step(self, latencies) -> None:
        """(position, seconds) pairs: one per token a step streamed."""
        context_of, bucket_of, limits, bounds = bisect.bisect_right, bisect.bisect_left, self.limits, self.bounds
        with self._lock:
            counts, sums = self._counts, self._sums
            for position, seconds in latencies:
                context = context_of(limits, position)  # (position < limit: the limit's bucket)
                counts[context][bucket_of(bounds, seconds)] += 1  # (seconds <= bound)
                sums[context] += seconds

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["context"])
        with self._lock:
            counts, sums = [list(c) for c in self._counts], list(self._sums)
        les = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        for label, per_bucket, total in zip(self.labels, counts, sums):
            cumulative, running = [], 0
            for le, count in zip(les, per_bucket):
                running += count
                cumulative.append((le, running))
            family.add_metric([label], cumulative, total)
        yield family


class Metrics:
    """One registry per app (tests build many apps in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds, …
        self._process: object = ProcessCollector(registry=r)
        self.count_request: Callable[[str, str], None] = self.counted  # (N > 1 frontends: through the core)
        self.ttft = Histogram("linserve_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=REQUEST_BUCKETS, registry=r)
        self.itl = ContextLatencies(LATENCY_BUCKETS, r)
        self.e2e = Histogram("linserve_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_wait = Histogram("linserve_queue_wait_seconds", "Time from arrival to admission into a state slot.",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self.step = Histogram("linserve_engine_step_seconds", "Duration of one engine step, by phase.", ["phase"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("linserve_batch_size", "Sequences decoded per engine step.", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.requests = Counter("linserve_requests_total", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("linserve_requests_finished_total", "Finished generations by finish reason.",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("linserve_prompt_tokens_total", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter("linserve_generation_tokens_total", "Tokens generated.", registry=r)
        self.running = Gauge("linserve_requests_running", "Requests decoding now.", registry=r)
        self.waiting = Gauge("linserve_requests_waiting", "Requests queued or prefilling.", registry=r)
        self.sessions = Gauge("linserve_sessions", "Sessions by storage tier.", ["tier"], registry=r)
        self.state_bytes = Gauge("linserve_state_bytes_per_session", "Bytes of one session's recurrent state.",
                                 registry=r)
        self.pool_bytes = Gauge("linserve_state_pool_bytes", "State pool bytes (total allocated, in use).", ["kind"],
                                registry=r)
        self.prefix_queries = Counter("linserve_prefix_cache_queries_total", "Prefix-cache lookups.", registry=r)
        self.preemptions = Counter("linserve_preemptions_total", "Running requests parked for more urgent ones "
                                   "(scheduling_policy priority): their states wait on the host.", registry=r)
        self.spec_drafted = Counter("linserve_spec_draft_tokens_total", "Speculative decoding: drafted tokens "
                                    "verified.", registry=r)
        self.spec_accepted = Counter("linserve_spec_accepted_tokens_total", "Speculative decoding: drafted tokens "
                                     "accepted (emitted without a step of their own).", registry=r)
        self.prefix_hits = Counter("linserve_prefix_cache_hits_total", "Prefix-cache lookups that found a prefix.",
                                   registry=r)
        self.store_ops = Counter("linserve_session_store_operations_total",
                                 "Session-store calls by operation and result (ok, or the kind of failure: timeout, "
                                 "connection, permission, missing, io, error).", ["op", "result"], registry=r)
        self.store_loads = Counter("linserve_session_store_loads_total",
                                   "Session records read from the store into this replica (it held no current copy: "
                                   "after a restart, or a session last changed on another replica). Per continue, "
                                   "near 0 with session-affinity routing, near 1 - 1/replicas without.", registry=r)
        self.store_up = Gauge("linserve_session_store_up", "1 while the session store takes calls, 0 while it is "
                              "down or not answering (set by every call and by probes).", registry=r)
        self.store_skipped = Counter("linserve_session_store_records_skipped_total",
                                     "Unreadable session-store records skipped by listings.", registry=r)
        self.store_seconds = Histogram("linserve_session_store_seconds", "Session-store operation time.", ["op"],
                                       buckets=REQUEST_BUCKETS, registry=r)
        self.store_up.set(1)
        for tier in ("device", "host", "store"):
            self.sessions.labels(tier)
        # the children the engine thread observes every step, looked up once (a labels() call takes a lock)
        self._step = {phase: self.step.labels(phase) for phase in ("decode", "prefill", "mixed")}
        self._pool_gauges = (self.running, self.waiting, self.pool_bytes.labels("in_use"),
                             *(self.sessions.labels(tier) for tier in ("device", "host", "store")))
        self._pool_values: tuple | None = None  # as last set: a step that changed none sets none

    def counted(self, endpoint: str, status: str) -> None:
        """An answered HTTP request (`linserve_requests_total`)."""
        self.requests.labels(endpoint, status).inc()

    def describe_processes(self, root_pid: int) -> None:
        """`process_*` of the whole server (`api_servers` >= 1): `root_pid` and its children, summed."""
        self.registry.unregister(self._process)
        self._process = ProcessTree(root_pid)
        self.registry.register(self._process)

    def watch_decode_step(self, describe: Callable[[], dict | None]) -> None:
        """Export the decode step's compile status and compile=auto verdict, read at each scrape."""
        self.registry.register(DecodeStepCollector(describe))

    def set_pool(self, state_bytes: int, total_bytes: int) -> None:
        self.state_bytes.set(state_bytes)
        self.pool_bytes.labels("total").set(total_bytes)
        self.pool_bytes.labels("in_use").set(0)

    def observe(self, stats: object) -> None:
        """The engine's stats sink (runs on the engine thread; prometheus-client is thread-safe)."""
        if isinstance(stats, StepStats):
            self._step[stats.phase].observe(stats.duration_s)
            if stats.batch_size:
                self.batch_size.observe(stats.batch_size)
            if stats.preempted:
                self.preemptions.inc(stats.preempted)
            if stats.drafted:
                self.spec_drafted.inc(stats.drafted)
                self.spec_accepted.inc(stats.accepted)
            if stats.token_latencies:
                self.itl.observe_step(stats.token_latencies)
        elif isinstance(stats, PoolStats):
            values = (stats.running, stats.waiting, stats.state_bytes_in_use, stats.sessions_device,
                      stats.sessions_host, stats.sessions_store)
            if values != self._pool_values:
                for gauge, value in zip(self._pool_gauges, values):
                    gauge.set(value)
                self._pool_values = values
        elif isinstance(stats, RequestStats):
            self.queue_wait.observe(stats.queue_wait_s)
            if stats.ttft_s is not None:
                self.ttft.observe(stats.ttft_s)
            self.e2e.observe(stats.e2e_s)
            self.finished.labels(stats.finish_reason.value).inc()
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.generation_tokens.inc(stats.generated_tokens)
            if stats.prefix_cache_hit is not None:
                self.prefix_queries.inc()
                if stats.prefix_cache_hit:
                    self.prefix_hits.inc()

        elif isinstance(stats, StoreStats):
            self.store_ops.labels(stats.op, stats.result).inc()
            self.store_seconds.labels(stats.op).observe(stats.seconds)
            self.store_up.set(int(stats.up))
        elif isinstance(stats, RecordSkipped):
            self.store_skipped.inc()
        elif isinstance(stats, SessionLoaded):
            self.store_loads.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProcessTree:
    """The standard `process_*` series for a server of several processes (`api_servers` >= 1: `serve`, the
    engine core, the frontends): CPU seconds, memory and open descriptors summed over the root and its
    children; the start time and the descriptor limit are the root's."""

    OWN = ("process_start_time_seconds", "process_max_fds")

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid

    def pids(self) -> list[int]:
        parent = str(self.root_pid)
        children = [int(entry) for entry in os.listdir("/proc")
                    if entry.isdigit() and (fields := stat_fields(entry)) and fields[1] == parent]
        return [self.root_pid, *children]

    def collect(self):
        families: dict = {}
        for pid in self.pids():
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                for sample in family.samples:
                    if sample.name not in families:
                        families[sample.name] = (family, sample.value)
                    elif sample.name not in self.OWN:
                        families[sample.name] = (families[sample.name][0], families[sample.name][1] + sample.value)
        for family, value in families.values():
            kind = CounterMetricFamily if family.type == "counter" else GaugeMetricFamily
            yield kind(family.name, family.documentation, value=value)


class DecodeStepCollector:
    """`linserve_decode_step_info{compile,status,verdict}` 1, `linserve_decode_buckets_ready`, each compiled bucket's
    thread count, the intra-op counts in force and the CPUs others held (adapt_threads), and once
    compile=auto has measured (CPU): the compiled step's gain over eager, the CPU contention during that
    measurement, whether the verdict is provisional (made under load: measured again when quiet) and when it
    was measured (see server/engine/compile/verdict.py)."""

    def __init__(self, read: Callable[[], dict | None]) -> None:
        self.read = read  # (no `describe` attribute: the registry would take it for the metric names)

    def collect(self):
        step = self.read()
        if step is None:
            return
        verdict = step.get("verdict")
        info = GaugeMetricFamily("linserve_decode_step_info", "The decode step: compile setting, status (eager, "
                                 "pending, compiling, compiled, declined, failed) and compile=auto's verdict.",
                                 labels=["compile", "status", "verdict"])
        info.add_metric([step["compile"], step["status"], verdict["decision"] if verdict else "none"], 1)
        yield info
        yield GaugeMetricFamily("linserve_decode_buckets_ready", "Batch-size buckets of the decode step served "
                                "compiled.", value=len(step["ready"]))
        if step.get("threads"):
            threads = GaugeMetricFamily("linserve_compiled_step_threads", "The intra-op CPU threads a compiled "
                                        "program's bucket runs on, as its served steps' timing chose between "
                                        "`threads` and `kernel_threads`.", labels=["program", "bucket"])
            for key, count in step["threads"].items():
                threads.add_metric(key.split("/", 1), count)
            yield threads
        contention = step.get("cpu_contention")
        if contention:
            counts = GaugeMetricFamily("linserve_intra_op_threads", "The engine's intra-op CPU threads in force now "
                                       "per phase (decode, compiled, prefill): the ceilings, capped while other "
                                       "processes hold the CPUs (adapt_threads).", labels=["phase"])
            for phase in ("decode", "compiled", "prefill"):
                counts.add_metric([phase], contention[phase])
            yield counts
            yield GaugeMetricFamily("linserve_cpu_others_held", "CPUs of the engine's affinity mask (or quota) that "
                                    "other processes used in the last window it measured while stepping.",
                                    value=contention["others_held"])
        if verdict is None:
            return
        yield GaugeMetricFamily("linserve_decode_compile_gain", "compile=auto: eager time / compiled time of one "
                                "decode program call at the measured bucket (median of interleaved rounds).",
                                value=verdict["gain"])
        yield GaugeMetricFamily("linserve_decode_compile_contention_ratio", "compile=auto: share of the "
                                "measurement's time that runnable tasks waited for a CPU.", value=verdict["contention"])
        yield GaugeMetricFamily("linserve_decode_compile_verdict_provisional", "compile=auto: 1 while the verdict "
                                "was made under load (measured again when the machine is quiet).",
                                value=int(verdict["provisional"]))
        yield GaugeMetricFamily("linserve_decode_compile_verdict_timestamp_seconds", "compile=auto: when the "
                                "verdict was measured (unix time).", value=verdict["measured_at"])
