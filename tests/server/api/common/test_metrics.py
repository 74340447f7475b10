"""The engine's stats sink: each observation lands in the right series (children looked up once, gauges set
only when a value changed), read back from the rendered text format."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from linserve.server.api.common.metrics import CONTEXT_BUCKETS, LATENCY_BUCKETS, ContextLatencies, Metrics
from linserve.server.engine.types import PoolStats, StepStats


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def pool(**overrides) -> PoolStats:
    values = dict(running=0, waiting=0, slots_in_use=0, slots_total=8, state_bytes_in_use=0, sessions_device=0,
                  sessions_host=0, sessions_store=0)
    return PoolStats(**{**values, **overrides})


def test_step_stats_observe_phase_batch_and_each_token_by_context():
    metrics = Metrics()
    metrics.observe(StepStats(0.004, "decode", 3, 3, 0, ((10, 0.001), (2000, 0.002), (70000, 0.003))))
    metrics.observe(StepStats(0.020, "mixed", 1, 1, 16, ((5, 0.004),)))
    metrics.observe(StepStats(0.010, "prefill", 0, 0, 16))
    got = samples(metrics)
    for phase, seconds in (("decode", 0.004), ("mixed", 0.020), ("prefill", 0.010)):
        assert got[("linserve_engine_step_seconds_count", (("phase", phase),))] == 1
        assert abs(got[("linserve_engine_step_seconds_sum", (("phase", phase),))] - seconds) < 1e-12
    assert got[("linserve_batch_size_count", ())] == 2  # a prefill-only step decodes nothing
    assert got[("linserve_batch_size_sum", ())] == 4
    itl = {label: got[("linserve_inter_token_latency_seconds_count", (("context", label),))]
           for label in ("0-1k", "1k-4k", "4k-16k", "16k-64k", "64k+")}
    assert itl == {"0-1k": 2, "1k-4k": 1, "4k-16k": 0, "16k-64k": 0, "64k+": 1}


def test_pool_gauges_follow_every_change_and_hold_between():
    metrics = Metrics()
    metrics.set_pool(1000, 8000)
    first = pool(running=2, waiting=1, state_bytes_in_use=2000, sessions_device=1, sessions_host=3, sessions_store=5)
    metrics.observe(first)
    metrics.observe(first)  # unchanged: nothing to set, nothing lost
    got = samples(metrics)
    assert got[("linserve_requests_running", ())] == 2
    assert got[("linserve_requests_waiting", ())] == 1
    assert got[("linserve_state_pool_bytes", (("kind", "in_use"),))] == 2000
    assert got[("linserve_state_pool_bytes", (("kind", "total"),))] == 8000
    assert [got[("linserve_sessions", (("tier", t),))] for t in ("device", "host", "store")] == [1, 3, 5]
    metrics.observe(pool())  # everything back to zero
    got = samples(metrics)
    assert got[("linserve_requests_running", ())] == 0
    assert got[("linserve_state_pool_bytes", (("kind", "in_use"),))] == 0
    assert [got[("linserve_sessions", (("tier", t),))] for t in ("device", "host", "store")] == [0, 0, 0]


def test_the_context_latencies_render_as_prometheus_clients_histogram_would():
    """The ITL histogram takes a step's tokens in one call; its text is a Histogram's, sample for sample."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = ContextLatencies(LATENCY_BUCKETS, ours)
    reference = Histogram(fast.name, fast.documentation, ["context"], buckets=LATENCY_BUCKETS, registry=theirs)
    labels = [label for _, label in CONTEXT_BUCKETS] + ["64k+"]
    for label in labels:
        reference.labels(label)
    rng = random.Random(5)
    edges = [*LATENCY_BUCKETS, 0.0, 20.0]  # on a bound, below the first, past the last
    for _ in range(50):
        step = [(rng.choice([0, 5, 1023, 1024, 4095, 4096, 16383, 16384, 65535, 65536, 10**6]),
                 rng.choice([rng.uniform(0, 0.02), rng.choice(edges)])) for _ in range(rng.randint(0, 8))]
        fast.observe_step(step)
        for position, seconds in step:
            label = next((lb for limit, lb in CONTEXT_BUCKETS if position < limit), "64k+")
            reference.labels(label).observe(seconds)
    assert generate_latest(ours) == generate_latest(theirs)


def test_each_compiled_bucket_s_thread_count_is_a_labelled_gauge():
    metrics = Metrics()
    step = {"compile": "on", "status": "compiled", "ready": [1, 8], "verdict": None,
            "threads": {"decode/1": 1, "decode/8": 2, "verify8/1": 2}}
    metrics.watch_decode_step(lambda: step)
    got = samples(metrics)
    assert {labels: value for (name, labels), value in got.items() if name == "linserve_compiled_step_threads"} == {
        (("bucket", "1"), ("program", "decode")): 1, (("bucket", "8"), ("program", "decode")): 2,
        (("bucket", "1"), ("program", "verify8")): 2}
    step["threads"] = {}  # (none tried yet, or `kernel_threads` set): no such series
    assert not any(name == "linserve_compiled_step_threads" for name, _ in samples(metrics))


def test_the_counts_in_force_and_the_cpus_others_held_are_gauges():
    metrics = Metrics()
    step = {"compile": "on", "status": "compiled", "ready": [1], "verdict": None,
            "cpu_contention": {"decode": 1, "compiled": 2, "prefill": 1, "others_held": 0.87}}
    metrics.watch_decode_step(lambda: step)
    got = samples(metrics)
    assert {labels: value for (name, labels), value in got.items() if name == "linserve_intra_op_threads"} == {
        (("phase", "decode"),): 1, (("phase", "compiled"),): 2, (("phase", "prefill"),): 1}
    assert got[("linserve_cpu_others_held", ())] == 0.87
    del step["cpu_contention"]  # (a plan that does not adapt: counts fixed, nothing measured)
    assert not any(name in ("linserve_intra_op_threads", "linserve_cpu_others_held") for name, _ in samples(metrics))
