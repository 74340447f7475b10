"""The engine's plain-dataclass interface: what goes in (requests, sampling params), what comes out
(per-token outputs, stats). No pydantic here: the HTTP schema converts itself into these."""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field, fields


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller or the server shutting down
    ERROR = "error"  # the engine failed while serving it (the error is logged; other requests go on)


# Seeds: ±2**53, inside what torch.Generator.manual_seed accepts ([-2**63, 2**64 - 1]) and exact as a double,
# so JSON tools that read integers as floats agree with the server on every seed. Row i of a request uses
# (seed + i) mod 2**64, always a valid generator seed.
SEED_MIN, SEED_MAX = -(2**53), 2**53
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs from the server's settings, field for field (the defaults, and what each one
    means, live once: in `server.settings.Settings`)."""

    num_slots: int
    max_batch_tokens: int  # decode rows + prefill tokens per step
    max_prefill_chunk: int
    max_prefill_while_decoding: int  # prefill tokens per step while streams decode (their ITL bound)
    prefix_cache_entries: int
    max_host_sessions: int
    session_ttl_s: float
    max_n: int
    max_waiting: int
    scheduling_policy: str  # "fcfs" or "priority"
    priority_aging_s: float  # priority: each this many seconds waited is one level more urgent
    max_context: int  # softmax models only: KV-cache capacity per slot
    reserved_slots: int  # slots idle sessions never pin: stateless work always finds room (at least max_n)
    session_turns_kept: int
    session_text_chars: int  # each session's turn text kept with it (prompt and completion), at most
    session_store: str  # "none", "dir:PATH" or "redis://HOST:PORT/DB": the tier below host memory
    session_store_timeout_s: float
    compile: str  # the decode step: "off" (eager), "on" or "auto" (see compiled_decode)
    compile_autotune: bool  # CPU builds: max-autotune GEMM choices (slower builds, faster programs)
    compile_cache_dir: str | None
    compile_cache_max_gb: float  # the least recently used model directories beyond it are removed
    speculative: str  # a request's speculative decoding when it does not say: "off", "ngram" or "draft"
    speculative_k: int  # drafts verified per step at most (the verification program's width)
    speculative_always: bool  # verify whenever a row has drafts, whatever it costs (else: while it pays)
    threads: int | None  # torch intra-op CPU threads; None: derived from the CPUs this process may use
    prefill_threads: int | None  # the same while the chunked form (prefill) runs
    kernel_threads: int | None  # the same while a compiled CPU program runs (linserve's kernels in it)
    adapt_threads: bool  # both are ceilings, lowered while other processes hold the CPUs (cpu_contention.py)
    kernel_pool: bool  # CPU: linserve's kernels on their own pool while a program built for one thread runs
    prefill_program_tokens: int  # CPU: short prompt chunks as compiled programs of this many tokens; 0: eager
    session_responses_mb: float = 64.0  # a session's stored responses (their own store entries), at most
    prefix_cache_mb: float = 1024.0  # the prefix cache's states, at most (its entries: the fewer of the two)
    host_sessions_mb: float = 4096.0  # offloaded sessions' states in host memory, at most (likewise)

    @classmethod
    def from_settings(cls, settings: object, **overrides: object) -> EngineConfig:
        """Each field from the attribute of the same name (any object: the engine does not import the
        settings class), then `overrides` (e.g. num_slots computed from a memory budget)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls)}
        return cls(**{**values, **overrides})


def _rebuilt_error(cls: type, args: tuple, state: dict) -> Exception:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class EngineError(Exception):
    """A request the engine cannot serve; `kind` maps to an HTTP status in the server. Pickles whole (kind,
    param and a subclass's own fields): the engine core process answers its frontends with it."""

    def __init__(self, message: str, kind: str = "invalid", param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.kind, self.param = message, kind, param

    def __reduce__(self):
        return _rebuilt_error, (type(self), self.args, dict(self.__dict__))


SPECULATIVE_METHODS = ("off", "ngram", "draft")


@dataclass(frozen=True)
class Speculation:
    """A request's speculative decoding: drafts by `method` ("ngram": prompt lookup; "draft": the draft model),
    at most `k` per step."""

    method: str
    k: int | None = None  # None: the server's speculative_k

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise EngineError(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                              f"{self.method!r}", param="speculative")
        if self.k is not None and self.k < 1:
            raise EngineError(f"speculative.k must be >= 1, got {self.k}", param="speculative")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF-style, over prompt and generated tokens
    presence_penalty: float = 0.0  # OpenAI-style, over generated tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None  # top-N alternatives per token (0 = only the chosen token's)
    prompt_logprobs: int | None = None  # the prompt's own tokens scored, with top-N alternatives (None: not)
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    grammar: object | None = None  # constraint.Grammar: only tokens it allows (structured outputs)
    priority: int = 0  # lower is served first under `scheduling_policy: priority` (vLLM's sense); else unused
    speculative: Speculation | None = None  # None: the server's default (EngineConfig.speculative)

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 0, "must be >= 0"),
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), "must be >= 0"),
            ("top_k", 0 <= self.top_k <= MAX_TOP_K, "must be >= 0 (0 disables)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "must be in [0, 20]"),
            ("n", self.n >= 1, "must be >= 1"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, f"must be in [{SEED_MIN}, {SEED_MAX}]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("logit_bias", all(-100 <= bias <= 100 for _, bias in self.logit_bias), "biases must be in [-100, 100]"),
        ]
        for name, ok, message in checks:
            if not ok:
                raise EngineError(f"{name} {message}, got {getattr(self, name)!r}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_filters(self) -> bool:
        """top-k, top-p or min-p on a sampled row: drawn from the sorted distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None  # continue this session: its state, then the prompt
    owner: str | None = None  # the API key that sent it; sessions belong to their creator's key
    idempotency: Idempotency | None = None  # a session turn applied at most once per key (kept in its record)
    expected_revision: str | None = None  # continue only if the session is still at this revision


@dataclass(frozen=True)
class Idempotency:
    """A client's idempotency key for a change of a session: applied at most once; a retry gets the result."""

    key: str  # digest of the owner and the client's key
    request: str  # digest of the request (method, path, body): a key reused for another request is refused
    created: int  # unix time of the first attempt (the response's `created`, replayed as it was)
    note: dict | None = field(default=None, compare=False)  # kept with the result (a stored response's request)
    # a stored response: its result is also kept as the session's own store entry (named `key`) for the session's
    # whole life, not only among the newest APPLIED_KEPT in its record
    entry: bool = False


class AlreadyApplied(EngineError):
    """The session already holds the change this key names: `result` is what it answered (None: not kept)."""

    def __init__(self, session_id: str, result: dict | None) -> None:
        super().__init__(f"this Idempotency-Key was already applied to session {session_id!r}", kind="already_applied",
                         param="Idempotency-Key")
        self.result = result


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) alternatives, best first


@dataclass(slots=True)
class RequestOutput:
    """One event of one sequence: a new token (with its text delta) and/or the end of the sequence. Made once a row
    a step in the engine and again in the frontend when it crosses, and never changed after (`dataclasses.replace`
    makes another): slots and a plain __init__, 0.12 µs a construction against a frozen dataclass's 1.0–1.4
    (its `object.__setattr__` per field)."""

    request_id: str
    index: int  # which of the n sequences
    token_id: int | None
    text: str  # new text since the previous output (stop strings withheld)
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    position: int = 0  # the token's position in its whole sequence (session history included)
    session_id: str | None = None
    error: str | None = None  # with finish_reason ERROR: what went wrong (no internals)
    error_kind: str | None = None  # with an error: its EngineError kind (e.g. "store_unavailable": a 503)
    # on each row's first output when the request asked for prompt_logprobs: one entry per prompt token, the
    # first None unless a session's history predicts it
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    end_of_text: bool = False  # the token is one of the model's end-of-text ids (it adds no text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __reduce__(self) -> tuple:
        """Pickled as its fields in order (half the time of a dataclass's pickling, by name). A step's outputs
        cross to the frontend as `output_values` tuples, which need no Python call at all."""
        return RequestOutput, output_values(self)


def values_of(cls: type) -> Callable[[object], tuple]:
    """A dataclass's fields in order, as a tuple, in one C call: cls(*values_of(cls)(obj)) is the same object (what
    C pickles whole, where an object's own reduction is a Python call)."""
    return operator.attrgetter(*(f.name for f in fields(cls)))


output_values = values_of(RequestOutput)


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP side reads about a started engine and its model — fixed while it runs, so a frontend
    in another process holds a copy (engine_process/) instead of asking."""

    device: str
    threads: int  # the decode step's intra-op CPU threads
    cpu_threads: dict  # cpu_threads.ThreadPlan, described
    weights_dtype: str
    projections: dict  # model.projection.describe(): how the projections run in the engine's process
    model_type: str
    state_bytes: int | None  # one session's state (None: the softmax baseline's KV cache grows)
    vocab_size: int  # served (the tokenizer's)
    checkpoint_vocab_size: int  # as the checkpoint has it (padded past the tokenizer, maybe)
    reserved_slots: int
    slot_bytes: int
    pool_bytes: int
    decode_step: bool  # whether there is a decode step to describe (compile status)
    checkpoint: str | None = None  # the directory the model was loaded from


@dataclass(slots=True)
class StepStats:
    """One engine step, made every step (slots and a plain `__init__`, as `RequestOutput`: never changed after it
    is made) and crossing to a frontend as its fields' tuple (`step_values`)."""

    duration_s: float
    phase: str  # "decode", "prefill" or "mixed"
    batch_size: int  # sequences decoded this step
    decode_tokens: int
    prefill_tokens: int
    # (position, seconds since the row's previous token) for every token this step: observed as it
    # happens, so no request keeps a list that grows with its length
    token_latencies: tuple[tuple[int, float], ...] = ()
    program_s: float = 0.0  # of duration_s, inside the decode program call (on CUDA only its launch: asynchronous)
    preempted: int = 0  # running requests parked for more urgent ones when this step was planned
    drafted: int = 0  # speculative decoding: drafted tokens verified this step, and those accepted
    accepted: int = 0


@dataclass(slots=True)
class PoolStats:
    """Occupancy, emitted after every step and every batch of commands (aborts, session changes); never changed
    after it is made, and crossing as its fields' tuple (`pool_values`)."""

    running: int
    waiting: int
    slots_in_use: int
    slots_total: int
    state_bytes_in_use: int
    sessions_device: int
    sessions_host: int
    sessions_store: int = 0  # records in the session store


step_values = values_of(StepStats)
pool_values = values_of(PoolStats)


@dataclass(frozen=True)
class RequestStats:
    request_id: str
    queue_wait_s: float
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int
    generated_tokens: int
    finish_reason: FinishReason
    prefix_cache_hit: bool | None  # None: not a stateless request (no lookup)


@dataclass(frozen=True)
class StoreStats:
    """One session-store call (emitted by the store worker's thread)."""

    op: str  # "get", "put", "delete", "list", "sweep", "renew", "release", "ping"
    result: str  # "ok", or the kind of failure: "timeout", "connection", "permission", "missing", "io", "error"
    seconds: float
    up: bool  # the store's health after this call


@dataclass(frozen=True)
class SessionLoaded:
    """A session record was read from the store into this process (it held no current copy)."""


@dataclass(frozen=True)
class RecordSkipped:
    """A listing met a store record it cannot read, and skipped it."""
