"""Speculative decoding's policy: which rows verify drafts this step, how many, and whether verifying pays.

A verification step (verify_program.py) costs more than a decode step — k + 1 tokens per row through the
model — and gives each row 1 + its accepted drafts. It pays when the batch's expected tokens per second of
verification beat one token per row per second of decoding. Both costs are *measured*: a program's cost per
(program, batch bucket, compiled or eager) is the least of its last 8 timings, and a width is timed twice before
it is weighed (its first call pays for one-off set-up). A row's expected tokens come from its own acceptance so far
(accepted drafts over drafts tested, with a prior of one half, decaying so it follows the text):
1 + a + a² + … + a^d for d drafts. A large batch makes verification cost more than it saves, so it backs off
to plain decode steps by itself; it times verification again after `REPROBE_STEPS` refusals, and after twice
as many each time that finds it still does not pay (up to `REPROBE_MAX`): a batch that stays too large for
speculation spends ever less on asking. Only widths whose program runs as the decode step does are timed again
(an eager verification beside a compiled decode step costs 10-40 of its steps: its one eager timing stands).
Verification chosen on its merits starts the count over. The counts are kept per batch bucket: that
verification pays for 2 rows says nothing of 32.

Rows that verify no drafts (limit 0) still ride in a verification step and get exactly a decode step's token:
rows with logprobs, top-k/top-p/min-p filters on sampled rows, structured output (their mask changes per
token), a session turn with stop strings (it may end inside the drafts, and a session's state must end at
its last token), and rows within one token of max_tokens.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from ..compile.compiled_decode import DecodeStep
from ..decode_program import verify_kind
from ..live import Row
from ..types import EngineConfig, EngineError, SamplingParams
from .draft_model import DraftKind, DraftModel
from .drafting import NgramDrafter, until_end

REPROBE_STEPS = 64  # decode steps chosen over verification before verification is timed again...
REPROBE_MAX = 256  # ...doubling (to this) each time it still does not pay: a long generation keeps asking
QUIET_STEPS = 8  # after a refusal, steps of that batch bucket decoded without weighing verification again
COST_SAMPLES = 8  # a program's cost: the least of its last 8 timings (noise only adds time: an interrupted step,
# a first call's one-off set-up — a running mean let one slow first timing refuse verification for the whole run)
TIMINGS_TO_TRUST = 2  # a width is weighed once timed twice (its first call pays for set-up)
ACCEPT_DECAY = 0.9  # a row's acceptance counts fade so its estimate follows the text


@dataclass
class RowSpeculation:
    """A speculating row's drafter and acceptance so far (constant size)."""

    drafter: NgramDrafter
    k: int
    method: str = "ngram"
    accepted: float = 1.0  # prior: one accepted of two tested
    tested: float = 2.0
    draft_slot: int | None = None  # method "draft": the slot and generated count its draft state is current at
    draft_generated: int = -1

    def draft_current(self, row: Row) -> bool:
        return self.draft_slot == row.slot and self.draft_generated == row.num_generated

    def draft_at(self, row: Row, generated: int) -> None:
        self.draft_slot, self.draft_generated = row.slot, generated

    @property
    def rate(self) -> float:
        return self.accepted / self.tested

    def expected(self, drafts: int) -> float:
        """Tokens a verification step is expected to emit for this row with `drafts` drafts."""
        rate = self.rate  # 1 + rate + … + rate^drafts (rate < 1: the prior's refusal never decays to nothing)
        return drafts + 1.0 if rate >= 1.0 else (1.0 - rate ** (drafts + 1)) / (1.0 - rate)

    def observe(self, limit: int, kept: int) -> None:
        self.accepted = ACCEPT_DECAY * self.accepted + kept
        self.tested = ACCEPT_DECAY * self.tested + kept + (1 if kept < limit else 0)


def verify_widths(k: int) -> list[int]:
    """The verification programs compiled for at most k drafts: k, and 2 and 4 below it (a smaller width costs
    less per step: the policy picks the width that pays best — "backs off to a smaller k")."""
    return sorted({w for w in (2, 4) if w < k} | {k})


class SpeculationPolicy:
    def __init__(self, default_method: str, k: int, eos_ids: frozenset[int], bucket_of, draft=None,
                 widths: list[int] | None = None, paid=None, compile_gain=None) -> None:
        """`bucket_of(kind, rows) -> (size, compiled)`: where a program call of that many rows would run (kind
        "decode" or "verify{w}"); `draft`: the draft model (draft_model.DraftModel) when the server has one;
        `widths`: the verification programs there are (drafts per step), at most k; `paid(width, rows)`: told
        whenever verification is chosen on its merits (not to be measured), or would be once compiled — its
        program is worth compiling; `compile_gain()`: the decode step's measured eager / compiled time (None:
        not measured), what a verification program run eagerly is expected to gain compiled."""
        self.default_method, self.k, self.eos_ids, self.bucket_of = default_method, k, eos_ids, bucket_of
        self.paid = paid or (lambda width, rows: None)
        self.compile_gain = compile_gain or (lambda: None)
        self.draft, self.widths = draft, widths or [k]
        self.costs: dict[tuple[str, int, bool], float] = {}  # (kind, bucket, compiled) → seconds
        self.timings: dict[tuple[str, int, bool], deque[float]] = {}  # the recent timings behind each cost
        # per batch bucket (a batch size where verification does not pay says nothing of another):
        self.since_verify: defaultdict[int, int] = defaultdict(int)  # steps refused since verification last ran
        self.reprobe_after: dict[int, int] = {}  # refusals before it is timed again (absent: REPROBE_STEPS)
        self.reprobes = 0  # re-measurements so far: they take the widths in turn
        self.always = False  # verify whenever a row has drafts, whatever it costs (exactness tests, benchmarks)

    # ------------------------------------------------------------------ rows
    def method(self, params: SamplingParams) -> tuple[str, int]:
        """A request's method and its drafts a step at most."""
        spec = params.speculative
        if spec is None:
            return self.default_method, self.k
        return spec.method, min(spec.k or self.k, self.k)

    def limit(self, row: Row, k: int) -> int:
        """Drafts this row may verify now (0: it takes a decode step's token)."""
        params = row.live.request.params
        if params.logprobs is not None or params.uses_filters or row.constraint is not None:
            return 0
        if row.live.session is not None and params.stop:
            return 0
        return max(0, min(k, params.max_tokens - row.num_generated - 1))

    def speculating(self, row: Row) -> RowSpeculation | None:
        """The row's drafter, made on its first decode step (its prompt, a session's tail, its first token)."""
        if row.speculation is None:
            method, k = self.method(row.live.request.params)
            if method == "off":
                return None
            live = row.live
            context = (live.session.tail if live.session is not None else []) + live.request.prompt_ids[-4096:]
            row.speculation = RowSpeculation(NgramDrafter(context + [row.next_token], eos_ids=self.eos_ids), k, method)
        return row.speculation

    # ------------------------------------------------------------------ steps
    def plan(self, rows: list[Row]) -> Plan | None:
        """Each row's drafts for a verification step (and the program width), or None: a plain decode step pays
        more, or there is nothing to verify. First a bound — every speculating row with all the drafts it may
        verify at each width: the width with the best expected tokens per second is chosen, and if even that
        does not beat decoding, no draft is looked up (a backed-off batch costs next to nothing). Then prompt-
        lookup drafts are looked up (they decide whether there is anything to verify); the draft model runs only
        once verification is chosen (its rows count as full drafts)."""
        specs = [self.speculating(row) for row in rows]  # (every row's drafter from its first step on)
        bucket = self.bucket_of("decode", len(rows))[0]
        if self.since_verify[bucket] % QUIET_STEPS:  # refused a moment ago: a backed-off batch costs one lookup
            self.since_verify[bucket] += 1  # a step; it weighs again every QUIET_STEPS refused steps
            return None
        limits = [self.limit(row, spec.k) if spec is not None else 0 for row, spec in zip(rows, specs)]
        if not any(limits):
            return None
        modelled = [b for b, (spec, limit) in enumerate(zip(specs, limits))
                    if limit and spec.method == "draft" and self.draft is not None]
        suffix = "-draft" if modelled else ""
        bounds = {w: self._expected(specs, [min(limit, w) for limit in limits]) for w in self.widths}
        width, probing = self._width(len(rows), bucket, bounds, suffix)
        if width is None:
            return None
        limits = [min(limit, width) for limit in limits]
        drafts = [[0] * limit if b in modelled else spec.drafter.propose(limit) if limit else []
                  for b, (spec, limit) in enumerate(zip(specs, limits))]  # (draft-model rows: drafted below)
        if not any(drafts):  # nothing to verify; a probe waits for the next weighed step, not the next step
            self.since_verify[bucket] += probing and not self.always  # (rows that found no drafts looked them
            return None  # up every step, forever, once refused REPROBE_MAX steps)
        if not (probing or self._worth(len(rows), bucket, width, self._expected(specs, map(len, drafts)), suffix)):
            return None
        plan = Plan(drafts, width, modelled)
        if not probing:
            self.paid(width, len(rows))
        if modelled:
            members = [rows[b] for b in modelled]
            self.draft.sync(members)
            proposed, plan.draft_states = self.draft.propose(members)
            for b, draft in zip(modelled, proposed):
                draft = draft[: limits[b]]
                drafts[b] = until_end(draft, self.eos_ids)
        return plan

    @staticmethod
    def _expected(specs, drafts) -> float:
        return sum(spec.expected(n) if spec is not None else 1.0 for spec, n in zip(specs, drafts))

    def _cost(self, kind: str, rows: int) -> float | None:
        return self.costs.get((kind, *self.bucket_of(kind.removesuffix("-draft"), rows)))

    def _width(self, rows: int, bucket: int, bounds: dict[int, float], suffix: str) -> tuple[int | None, bool]:
        """(width, probing): the width whose expected tokens per second (its bound) are best, if they beat
        decoding's; or, probing, an unmeasured width, or after `reprobe_after` refusals one width again, to be
        measured (whatever the drafts found)."""
        if self.always:
            return self.widths[-1], True
        decode_cost = self._cost("decode", rows)
        if decode_cost is None:
            return None, False  # time a decode step first
        unmeasured = [w for w in self.widths if not self._trusted(f"verify{w}{suffix}", rows)]
        if unmeasured:
            return unmeasured[-1], True
        after = self.reprobe_after.get(bucket, REPROBE_STEPS)
        if self.since_verify[bucket] >= after:
            self.reprobe_after[bucket] = min(2 * after, REPROBE_MAX)  # (reset if it turns out to pay)
            alike = self._alike(rows)
            if alike:
                self.reprobes += 1
                return alike[self.reprobes % len(alike)], True
            self.since_verify[bucket] = 0  # (nothing worth timing again: weighed as they are)
        best = max(self.widths, key=lambda w: bounds[w] / self._cost(f"verify{w}{suffix}", rows))
        if bounds[best] / self._cost(f"verify{best}{suffix}", rows) > rows / decode_cost:
            self.reprobe_after.pop(bucket, None)
            return best, False
        self.since_verify[bucket] += 1
        if not suffix:
            self._want_compiled(rows, bounds, decode_cost)
        return None, False

    def _alike(self, rows: int) -> list[int]:
        """The widths worth timing again at this batch size: those whose program runs as the decode step does
        (compiled where it is compiled). A width run eagerly beside a compiled decode step is not: its eager cost,
        timed once, is all that is weighed (and what `_want_compiled` goes by) — timing it again cost a P15 load of
        8 streams 10-40 decode steps each time (an 8-draft verification eagerly 31-80 ms against a 2 ms step)."""
        decode_compiled = self.bucket_of("decode", rows)[1]
        return [w for w in self.widths if self.bucket_of(f"verify{w}", rows)[1] or not decode_compiled]

    def _want_compiled(self, rows: int, bounds: dict[int, float], decode_cost: float) -> None:
        """Verification refused because its program runs eagerly at this batch size while the decode step runs
        compiled: the width whose eager cost, divided by the gain compiling brought the decode step, would pay is
        worth compiling here (`paid`) — then it is measured compiled and weighed on its own cost. Without this
        an eager verification, weighed against a compiled decode step ~10x faster on a CPU, never paid, so its
        bucket was never built. (Prompt lookup only: a draft model's drafting, in the cost, gains no such factor.)"""
        gain = self.compile_gain()
        if not gain or gain <= 1.0 or not self.bucket_of("decode", rows)[1]:
            return
        for width in self.widths:
            if not self.bucket_of(f"verify{width}", rows)[1] and \
                    bounds[width] * gain / self._cost(f"verify{width}", rows) > rows / decode_cost:
                self.paid(width, rows)

    def _trusted(self, kind: str, rows: int) -> bool:
        key = (kind, *self.bucket_of(kind.removesuffix("-draft"), rows))
        return key in self.costs and len(self.timings.get(key, ())) != 1  # (a cost set without timings: given)

    def _worth(self, rows: int, bucket: int, width: int, expected: float, suffix: str) -> bool:
        """With the drafts found: still worth it."""
        if expected / self._cost(f"verify{width}{suffix}", rows) > rows / self._cost("decode", rows):
            return True
        self.since_verify[bucket] += 1
        return False

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        """A step's program time: kind "decode", or "verify{w}" / "verify{w}-draft" (drafting included)."""
        key = (kind, *self.bucket_of(kind.removesuffix("-draft"), rows))
        timings = self.timings.setdefault(key, deque(maxlen=COST_SAMPLES))
        timings.append(seconds)
        self.costs[key] = min(timings)
        if kind != "decode":
            self.since_verify[self.bucket_of("decode", rows)[0]] = 0

    def verified(self, rows: list[Row], plan: Plan, limits: list[int], kept: list[int], seconds: float) -> None:
        """After a verification step (delivered: the rows hold their new tokens): its whole time, each row's
        acceptance, the draft model's states rolled back."""
        self.observe(f"verify{plan.width}{'-draft' if plan.modelled else ''}", len(rows), seconds)
        for row, limit, n in zip(rows, limits, kept):
            if limit and row.speculation is not None:
                row.speculation.observe(limit, n)
        if plan.modelled:
            self.draft.rolled_back([rows[b] for b in plan.modelled], plan.draft_states,
                                   [kept[b] for b in plan.modelled])


@dataclass
class Plan:
    """A verification step's drafts (one list per row) and, for rows drafted by the draft model, its states."""

    drafts: list[list[int]]
    width: int  # the verification program's drafts per row
    modelled: list[int] = field(default_factory=list)  # rows (indices) drafted by the draft model
    draft_states: list = field(default_factory=list)  # the draft model's states after each draft (P_d, k+1, …)


class SpeculativeDecoding:
    """Speculative decoding's parts, composed once by the engine: the verification step (compiled after the
    decode step, once a request asks or the server's default is on), the draft model with its drafting step
    (when the server has one) and the policy."""

    def __init__(self, model, pool, sampling, device, config: EngineConfig, max_rows: int, decode_step: DecodeStep,
                 eos_ids: frozenset[int], draft_model=None) -> None:
        self.config, self.decode_step = config, decode_step
        self.verify_steps: dict[int, DecodeStep] = {}
        after = decode_step
        # a verification bucket is compiled once verification pays there (always: all of them), else loaded
        # from the cache if it is there: on 2 cores each takes minutes, and at 8 rows and more it rarely pays
        on_demand = not config.speculative_always
        for width in sorted(verify_widths(config.speculative_k), reverse=True):  # compiled one after another
            after = self.verify_steps[width] = DecodeStep(model, pool, sampling, device, config.compile, max_rows,
                                                          config.compile_cache_dir, config.compile_autotune,
                                                          kind=verify_kind(width), after=after, on_demand=on_demand,
                                                          cache_max_gb=config.compile_cache_max_gb)
        self.draft = None
        if draft_model is not None:
            self.draft = DraftModel(draft_model, config.num_slots, device)
            self.draft.step = DecodeStep(draft_model, self.draft.pool, sampling, device, config.compile, max_rows,
                                         config.compile_cache_dir, config.compile_autotune,
                                         kind=DraftKind(f"draft{config.speculative_k}"), after=decode_step,
                                         cache_max_gb=config.compile_cache_max_gb)
        self.policy = SpeculationPolicy(config.speculative, config.speculative_k, eos_ids, self.bucket_of, self.draft,
                                        sorted(self.verify_steps), paid=self.paid, compile_gain=self.compile_gain)
        self.policy.always = config.speculative_always

    def start(self, method: str) -> None:
        """Get the programs `method` needs compiled (each once; in the background, after the decode step)."""
        if method != "off":
            for step in self.verify_steps.values():
                step.start()
        if method == "draft" and self.draft is not None:
            self.draft.step.start()

    def admit(self, params: SamplingParams) -> None:
        """A request's `speculative`: refused (EngineError) when it asks for a draft model this server lacks."""
        method = params.speculative.method if params.speculative is not None else "off"
        if method == "draft" and self.draft is None:
            raise EngineError("speculative.method draft needs a draft model: this server has none (--draft-model)",
                              param="speculative")
        self.start(method)

    def close(self) -> None:
        for step in self.verify_steps.values():
            step.close()
        if self.draft is not None:
            self.draft.step.close()

    def describe(self) -> dict:
        """For /ready: the default method, k, the draft model, and how far their programs are compiled."""
        draft = None if self.draft is None else {
            "parameters": self.draft.model.num_parameters(), "draft_step": self.draft.step.describe()}
        return {"default": self.config.speculative, "k": self.config.speculative_k,
                "always": self.config.speculative_always,
                "verify_steps": {str(w): step.describe() for w, step in self.verify_steps.items()},
                "draft_model": draft}

    def paid(self, width: int, rows: int) -> None:
        """Verification of `width` drafts paid for `rows` rows: its bucket is worth compiling."""
        self.verify_steps[width].want(rows)

    def compile_gain(self) -> float | None:
        """The decode step's eager / compiled time as its `auto` verdict measured it (None: not measured)."""
        verdict = self.decode_step.verdict
        return verdict.measurement.gain if verdict is not None and verdict.decision == "compiled" else None

    def bucket_of(self, kind: str, rows: int) -> tuple[int, bool]:
        """Where a program call over `rows` rows runs now: (its bucket's size, compiled or eager)."""
        step = self.decode_step if kind == "decode" else self.verify_steps[int(kind.removeprefix("verify"))]
        ready = step.bucket_ready(rows)
        return (ready, True) if ready is not None else (next((s for s in step.sizes if s >= rows), rows), False)
