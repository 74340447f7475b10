"""Speculative decoding's policy (spec/speculation.py) on injected costs — the decision, not a timing, is under
test: which width verifies while it pays, when verification is timed again and at which widths, which buckets are
worth compiling, and what a backed-off batch spends on looking up drafts."""

from __future__ import annotations

from types import SimpleNamespace

from linserve.server.engine.spec.drafting import NgramDrafter
from linserve.server.engine.spec.speculation import (
    QUIET_STEPS,
    REPROBE_STEPS,
    RowSpeculation,
    SpeculationPolicy,
)
from linserve.server.engine.types import SamplingParams, Speculation

NGRAM = Speculation("ngram", 4)


def policy_row(slot: int, max_tokens: int, drafter: NgramDrafter | None = None) -> SimpleNamespace:
    """What the policy reads of a running greedy row that speculates with at most 4 drafts a step: its request's
    parameters, its slot and tokens, and its drafter (by default one whose history repeats [1, 2, 3, 4])."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=NGRAM)
    spec = RowSpeculation(drafter or NgramDrafter([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]), 4)
    return SimpleNamespace(live=SimpleNamespace(request=SimpleNamespace(params=params), session=None),
                           constraint=None, num_generated=1, slot=slot, next_token=2, speculation=spec)


def test_the_policy_verifies_only_while_it_pays():
    """Measured costs decide (injected here: the decision, not a timing, is under test): each width is timed
    once, the one with the best expected tokens per second is chosen while it beats decoding, a smaller width
    once the larger costs too much, and verification is timed again after REPROBE_STEPS refusals (then 2x, 4x...);
    after a refusal the next QUIET_STEPS - 1 steps of that batch size are not weighed at all. Only a choice made
    on the merits (not a probe) tells the server the width's program is worth compiling at that batch size."""
    def row(slot):
        return policy_row(slot, 100)

    paid = []
    policy = SpeculationPolicy("off", 4, frozenset({0}), lambda kind, rows: (rows, True), widths=[2, 4],
                               paid=lambda width, n: paid.append((width, n)))
    rows = [row(s) for s in range(4)]
    assert policy.plan(rows) is None  # no decode step timed yet
    policy.observe("decode", 4, 0.010)
    plan = policy.plan(rows)
    assert plan.width == 4 and plan.drafts == [[3, 4, 1, 2]] * 4  # not timed yet: timed now
    policy.observe("verify4", 4, 0.300)  # a first call (one-off set-up: 30x a decode step)...
    assert policy.plan(rows).width == 4  # ...is timed again before it is weighed
    policy.observe("verify4", 4, 0.030)  # 3x a decode step: 4 rows x ~1.94 expected tokens do not pay
    plan = policy.plan(rows)
    assert plan.width == 2 and plan.drafts == [[3, 4]] * 4  # the other width, not timed yet
    policy.observe("verify2", 4, 0.030)
    assert policy.plan(rows).width == 2
    policy.observe("verify2", 4, 0.030)
    assert policy.costs[("verify4", 4, True)] == 0.030  # the smallest recent timing: the first no longer weighs
    assert policy.plan(rows) is None  # neither pays
    assert paid == []  # probes only so far: nothing worth compiling
    for spec in (r.speculation for r in rows):  # the rows' drafts turn out to be accepted all the time
        for _ in range(20):
            spec.observe(4, 4)
    # refused a moment ago: for a few steps of this batch size it is not weighed again (one lookup a step)...
    assert all(policy.plan(rows) is None for _ in range(QUIET_STEPS - 1))
    assert policy.plan(rows).width == 4  # ...then: 4 x ~5 tokens per 30 ms beat 4 per 10 ms (and 4 x ~3 at width 2)
    assert paid == [(4, 4)]
    policy.observe("verify4", 4, 0.030)  # (the step ran)
    timed(policy, "verify4", 0.2)  # the wide one far too slow now, the narrow one at 20 ms:
    timed(policy, "verify2", 0.02)
    assert policy.plan(rows).width == 2  # 4 x ~3 tokens per 20 ms beat 4 per 10 ms
    assert paid == [(4, 4), (2, 4)]
    policy.observe("verify2", 4, 0.030)
    timed(policy, "verify2", 1.0)  # and now nothing pays: back off...
    assert all(policy.plan(rows) is None for _ in range(REPROBE_STEPS))
    plan = policy.plan(rows)  # ...and time one width again after REPROBE_STEPS refusals
    timed(policy, f"verify{plan.width}", 1.0)  # still far too slow: the next timing waits twice as long
    assert all(policy.plan(rows) is None for _ in range(2 * REPROBE_STEPS))
    plan = policy.plan(rows)
    timed(policy, f"verify{plan.width}", 1.0)
    assert all(policy.plan(rows) is None for _ in range(4 * REPROBE_STEPS))
    timed(policy, f"verify{policy.plan(rows).width}", 1.0)
    timed(policy, "verify4", 0.02)  # verifying pays again...
    timed(policy, "verify2", 0.02)
    assert policy.plan(rows) is not None and 4 not in policy.reprobe_after  # ...and the count starts over


def test_an_eager_verification_that_would_pay_compiled_gets_its_bucket_compiled():
    """Decoding runs compiled and verification eagerly (its bucket not built): weighed at its eager cost it does
    not pay and is refused — but where that cost divided by the gain compiling brought the decode step would pay,
    the width's bucket is asked for (`paid`), to be measured compiled; with a small gain, a compiled bucket or an
    eager decode step, nothing is asked for. (Without it a CPU's compiled decode step, ~10x its eager form, left
    every verification bucket unbuilt: P15 at one stream 0.94x.)"""
    def row(slot):
        made = policy_row(slot, 100)
        for _ in range(20):  # drafts accepted all the time: ~5 tokens a row at width 4, ~3 at width 2
            made.speculation.observe(4, 4)
        return made

    def asked(gain, compiled):
        paid = []
        policy = SpeculationPolicy("off", 4, frozenset({0}), lambda kind, rows: (rows, compiled[kind]),
                                   widths=[2, 4], paid=lambda width, n: paid.append((width, n)),
                                   compile_gain=lambda: gain)
        rows = [row(s) for s in range(4)]
        policy.observe("decode", 4, 0.010)  # 4 rows: 400 tokens/s decoding
        timed(policy, "verify4", 0.100)  # eager: 4 x ~5 tokens per 100 ms = ~200/s — does not pay as it is
        timed(policy, "verify2", 0.080)  # 4 x ~3 per 80 ms = ~150/s
        assert policy.plan(rows) is None
        return paid

    eager_verification = {"decode": True, "verify2": False, "verify4": False}
    assert asked(11.0, eager_verification) == [(2, 4), (4, 4)]  # ~1,650 and ~2,200 tokens/s compiled: both pay
    assert asked(1.5, eager_verification) == []  # ~300 and ~225: neither would
    assert asked(None, eager_verification) == []  # no measured gain: nothing to go by
    assert asked(11.0, {**eager_verification, "verify4": True}) == [(2, 4)]  # width 4 measured compiled already
    assert asked(11.0, {"decode": False, "verify2": False, "verify4": False}) == []  # both eager: weighed as they are


def test_verification_is_timed_again_only_where_it_runs_as_the_decode_step_does():
    """After REPROBE_STEPS refusals a width is timed again — only one whose program runs as the decode step does:
    beside a compiled decode step, an eager verification (its bucket not built) keeps its one eager timing (timing
    it again cost a P15 load of 8 streams 10-40 decode steps each time); with no width compiled, nothing is timed
    again and the count starts over; with the decode step eager too, every width is timed again in turn."""
    def row(slot):
        return policy_row(slot, 1000)

    def reprobed(compiled: dict[str, bool]) -> list[int]:
        """The widths timed again over 6 x REPROBE_STEPS refused steps, neither width paying."""
        policy = SpeculationPolicy("off", 4, frozenset({0}), lambda kind, rows: (rows, compiled[kind]),
                                   widths=[2, 4])
        rows = [row(s) for s in range(4)]
        policy.observe("decode", 4, 0.010)
        timed(policy, "verify4", 0.100)
        timed(policy, "verify2", 0.080)
        widths = []
        for _ in range(6 * REPROBE_STEPS):
            plan = policy.plan(rows)
            if plan is not None:
                widths.append(plan.width)
                policy.observe(f"verify{plan.width}", 4, 0.100)  # (still does not pay)
        return widths

    assert reprobed({"decode": True, "verify2": True, "verify4": False}) == [2, 2]  # at 64, then 128 more
    assert reprobed({"decode": True, "verify2": False, "verify4": False}) == []
    assert sorted(reprobed({"decode": False, "verify2": False, "verify4": False})) == [2, 4]


def test_a_backed_off_batch_whose_rows_find_no_drafts_looks_them_up_only_when_it_weighs():
    """Verification does not pay and the rows' text never repeats (no drafts): drafts are looked up only on the
    steps that weigh verification (one in QUIET_STEPS) — a probe that finds nothing to verify waits for the next
    of those. (It waited for the next step: once refused REPROBE_MAX steps every step probed, looking up every
    row's drafts — 200+ µs a step at 8 rows, a tenth of a compiled decode step.)"""
    lookups = []

    class CountingDrafter(NgramDrafter):
        def propose(self, k):
            lookups.append(k)
            return super().propose(k)

    def row(slot):
        return policy_row(slot, 100_000, CountingDrafter(list(range(100 * slot, 100 * slot + 50))))  # no repeats

    policy = SpeculationPolicy("off", 4, frozenset({0}), lambda kind, rows: (rows, True), widths=[2, 4])
    rows = [row(s) for s in range(1, 5)]
    policy.observe("decode", 4, 0.010)
    timed(policy, "verify4", 0.100)
    timed(policy, "verify2", 0.080)
    steps = 3000
    for step in range(steps):
        assert policy.plan(rows) is None
        for r in rows:
            r.speculation.drafter.push(10_000 + step)  # (never seen before)
    assert 0 < len(lookups) <= len(rows) * (steps // QUIET_STEPS), len(lookups)


def timed(policy, kind: str, seconds: float) -> None:
    """A program that now takes `seconds` every time (its whole window of recent timings)."""
    for _ in range(8):
        policy.observe(kind, 4, seconds)
