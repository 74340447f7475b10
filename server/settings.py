"""Server settings: the one pydantic-settings class, and the only reader of environment variables.

Precedence: CLI flag > environment (`LINSERVE_*`) > YAML file (`--config FILE`, else `configs/server.yaml`
when present) > the defaults below, which are the only defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

DEFAULT_CONFIG_FILE = Path("configs/server.yaml")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LINSERVE_", extra="forbid")

    model: str | None = Field(None, description="checkpoint directory; unset = the shipped default checkpoint")
    served_model_name: str = Field("linserve-shakespeare", description="the model id clients name and see")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    api_keys: list[str] = Field(default_factory=list, description="Bearer keys; empty = no auth")
    docs_public: bool = Field(False, description="serve /docs, /redoc, /openapi.json without a key when keys are set")
    web_ui: bool = Field(True, description="serve the web page at / (playground, sessions, per-token latency); "
                         "its API calls need the key like any client's")

    api_servers: int | None = Field(
        None, ge=0, le=64, description="0: the engine runs in the HTTP server's process (a thread); 1: the engine "
        "core runs in a process of its own (the device, model, state pool, scheduler and sessions) and the HTTP "
        "frontend talks to it over one channel of per-step batches (docs/engine.md, \"The engine core process\"); "
        "N > 1: N frontend processes share the port, each with its own channel to the one core. Unset: 1 where "
        "this process may use 2 CPUs or more (measured best on 2 cores), 0 on one")
    frontend_nice: int = Field(
        0, ge=0, le=19, description="with the engine core a process of its own (api_servers >= 1): how much "
        "lower each frontend's scheduling priority is than the core's (a nice increment; 0: the same). On 2 CPUs "
        "3-10 served one stream 1.13-1.19x faster and 8 streams 0.83-0.96x (docs/benchmarks.md)")
    num_slots: int = Field(64, ge=1, description="state pool slots (device-resident sessions + running rows)")
    state_memory_mb: float | None = Field(None, gt=0, description="if set, slots = this budget / state bytes")
    max_batch_tokens: int = Field(640, ge=1, description="decode rows + prefill tokens per engine step")
    max_prefill_chunk: int = Field(256, ge=1, description="prefill tokens per request per step")
    max_prefill_while_decoding: int = Field(16, ge=1, description="prefill tokens per step while streams decode")
    prefix_cache_entries: int = Field(64, ge=0)
    prefix_cache_mb: float = Field(1024.0, gt=0, description="the prefix cache's states at most: fewer entries "
                                   "than prefix_cache_entries where the model's state is large")
    max_host_sessions: int = Field(1024, ge=0, description="sessions offloaded to host memory")
    host_sessions_mb: float = Field(4096.0, gt=0, description="host memory for offloaded sessions' states at most: "
                                    "fewer sessions than max_host_sessions where the model's state is large")
    session_ttl_s: float = Field(3600.0, gt=0)
    session_turns_kept: int = Field(8, ge=0, description="turn snapshots kept per session for rewind")
    session_text_chars: int = Field(
        32_768, ge=0, le=1_000_000, description="characters of turn text (prompts and completions) a session keeps "
        "for GET /v1/sessions/{id}/turns and the web page, newest turns first; stored with it, outside the fixed "
        "state bytes (0: none)")
    session_responses_mb: float = Field(
        64.0, gt=0, description="stored responses (/v1/responses: text, usage, input) a conversation keeps in the "
        "session store for its whole life, at most; a response past it is not kept (retrieve says why)")
    session_store: str = Field(
        "dir:./data/sessions", description="'dir:PATH' (one file per session), 'redis://HOST:PORT/DB' or 'none'"
    )
    session_store_timeout_s: float = Field(
        2.0,
        gt=0,
        le=300,
        description="deadline of each session-store call: later, the request fails (503) and the call takes no effect",
    )
    max_n: int = Field(8, ge=1)
    max_prompts_per_request: int = Field(32, ge=1, description="prompts in one /v1/completions batch (400 beyond)")
    reserved_slots: int = Field(8, ge=0, description="slots idle sessions never pin (raised to max_n)")
    max_waiting: int = Field(256, ge=1, description="queued requests before 429")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="the order waiting requests get slots: arrival, or the request's `priority` (lower "
        "first; ties by arrival)")
    priority_aging_s: float = Field(5.0, gt=0, description="scheduling_policy priority: every this many seconds "
                                    "waited counts as one level more urgent, so no request waits forever")
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off", description="speculative decoding for requests that do not ask (their `speculative` field): ngram "
        "drafts by prompt lookup, draft by the draft model; verified k at a time in one pass from the session "
        "state, used only while it pays")
    draft_model: str | None = Field(None, description="the draft model (a small checkpoint with the served model's "
                                    "tokenizer, e.g. from `linserve train --config configs/train/draft.yaml`); "
                                    "unset: none")
    speculative_k: int = Field(8, ge=1, le=8, description="drafts verified per step at most (the verification "
                               "program's width; a request's speculative.k may be smaller)")
    speculative_always: bool = Field(False, description="verify a row's drafts whenever it has some, whatever "
                                     "it costs (benchmarks, exactness checks); off: only while verifying pays, "
                                     "as measured on this machine")
    max_context: int = Field(8192, ge=16, description="softmax models: KV-cache tokens per slot (400 beyond)")
    kv_memory_mb: float = Field(1024, gt=0, description="softmax models: slots = min(num_slots, this / slot bytes)")
    max_tokens_default: int = Field(16, ge=0, description="max_tokens when a request omits it (and the checkpoint's "
                                    "generation_config.json names no max_new_tokens, or this is set explicitly)")
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="auto: the checkpoint's generation_config.json gives the end-of-text ids and the defaults "
        "of temperature, top_p, top_k, min_p, repetition_penalty and max_tokens for a request that leaves them out "
        "(as vLLM); none: OpenAI's defaults and the tokenizer's end-of-text alone")
    max_tokens_limit: int = Field(1_000_000, ge=1)
    max_prompt_tokens: int = Field(131_072, ge=1, description="longest prompt accepted (400 beyond)")
    logprobs_memory_mb: float = Field(
        512, gt=0, description="memory that the logprobs of requests in flight may take (a scored prompt, a "
        "non-streamed response's tokens): a request needing more is a 400, one that does not fit beside the others "
        "a 429; sized for 2 cores / 2 GB")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this (408)")
    header_timeout_s: float = Field(
        5.0,
        gt=0,
        description="a connection must send a whole request head within "
        "this of opening or of its last response, else it is closed",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        description="open connections; beyond, a new one gets 503 and is "
        "closed (capped by the process's file-descriptor limit)",
    )
    max_chat_messages: int = Field(2048, ge=1, description="messages in one chat request (400 beyond)")
    retry_after_s: int = Field(1, ge=0)
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="compile the decode program per batch bucket (CPU: AOTInductor artifacts built by a "
        "child process; CUDA: graphs); auto: where it pays"
    )
    compile_autotune: bool = Field(
        False, description="CPU: Inductor's own GEMM templates, timed per bucket (max-autotune): faster programs, "
        "but a row's result then depends on its bucket and differs from prefill's — outputs are no longer "
        "batch-invariant (docs/engine.md, 'Same request, same tokens'); part of the cache key")
    prefill_program_tokens: int = Field(
        16, ge=0, le=256, description="CPU, compile on: prompt chunks of up to 16 × this many tokens run as compiled "
        "programs of this many (padded on the right; the same bits as eager prefill), for models whose state after "
        "every prefix fits 64 MiB a call; 0: every chunk eagerly. The default matches max_prefill_while_decoding")
    compile_cache_dir: str | None = Field(
        None, description="the compiled programs, one subdirectory per model, program source, dtype, torch version "
        "and device; unset: "
        "$XDG_CACHE_HOME/linserve/compile (else ~/.cache/linserve/compile), shared by every working directory")
    compile_cache_max_gb: float = Field(
        20.0, gt=0, description="the compile cache's size limit: when a server starts compiling, the least recently "
        "used model directories are removed until the cache holds at most this many GB — never one a live process "
        "serves from (each holds a lock on its directories)")
    threads: int | None = Field(
        None, ge=1, le=1024, description="intra-op CPU threads for the model's ops (torch/OpenMP); unset: the CPUs "
        "this process may use (affinity mask and cgroup quota) less one for the event loop — all of them for a model "
        "of at least 256 MiB of weights, whose decode step streams them from memory — between 1 and 4")
    prefill_threads: int | None = Field(
        None, ge=1, le=1024, description="intra-op CPU threads while the engine runs the chunked form (prefill, "
        "prompt scoring), whose GEMMs are large enough to split; unset: the CPUs this process may use, at most 8")
    kernel_threads: int | None = Field(
        None, ge=1, le=1024, description="intra-op CPU threads while a compiled CPU program (decode, verification) "
        "runs: its Inductor kernels keep the count they were built for (`threads`), linserve's own kernels (the "
        "projections, the scans) split over this one; unset: the CPUs this process may use, at most 4, never "
        "fewer than `threads`, for a step of at least 32 rows — narrower ones run on `threads` (a second thread "
        "spinning between their small regions takes the CPU the HTTP side needs) — and, with `adapt_threads`, "
        "each compiled step's bucket timed served on both counts and run on the faster; set: every compiled step")
    kernel_pool: bool = Field(
        True, description="CPU: while a compiled program built for one thread runs on more (`kernel_threads`), "
        "linserve's kernels (the projections, the scans) run their parallel regions on a pool of their own whose "
        "regions wait only for the threads that joined them — an OpenMP region waits at its end for every thread "
        "of its team, also one the HTTP side or another process holds off its CPU; the same bits either way. "
        "false: OpenMP's threads, as eager steps and prefill always use")
    adapt_threads: bool = Field(
        True, description="treat `threads`, `kernel_threads` and `prefill_threads` as ceilings: every 0.5 s the "
        "engine reads the kernel's CPU counters and runs each phase on the CPUs other processes leave free "
        "(rounded; at least 1) — libgomp's spinning workers cost 2-3x beside a busy neighbour, and the exact path "
        "computes the same bits on any thread count; and, `kernel_threads` unset, each compiled step's bucket runs on "
        "`threads` or `kernel_threads`, whichever its steps' measured cadence says is faster here (tried again "
        "every 30 s); false: always the ceilings, by rows")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights' dtype; the (S, z) state stays fp32. auto: bfloat16 on a CPU with bf16 in "
        "hardware (AVX512-BF16, AMX) or AVX512 / AVX2 (linserve's kernel, built with a C++ compiler), else float32")
    quantization: Literal["none", "int8"] = Field(
        "none", description="weight-only quantization of the projections: int8 — per output channel, made at load "
        "from the served weights, widened exactly inside linserve's kernel: half the bytes a decode step reads, the "
        "same batch invariance. Needs bf16 on a CPU (dtype auto or bfloat16) and the kernel (a C++ compiler)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    # set per load() call: which YAML file feeds this instance
    _yaml_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=cls._yaml_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **cli: Any) -> Settings:
        """Settings from CLI values (None = not given), env, YAML and defaults, in that order."""
        path = Path(config_file) if config_file else (DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None)
        if path is not None and not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        overrides = {k: v for k, v in cli.items() if v is not None and v != []}

        class _FromFile(cls):  # a subclass carries the YAML path into settings_customise_sources
            _yaml_file = path

        try:
            loaded = _FromFile(**overrides)
        except ValidationError as error:
            raise ValueError(describe_invalid(error, path)) from None
        # as the base class, validated once, remembering which settings were given (flag, env or file) and which
        # are defaults (a checkpoint's generation_config.json gives way to an operator's own max_tokens_default)
        return cls.model_construct(_fields_set=loaded.model_fields_set, **loaded.model_dump())

    def engine_placement(self) -> int:
        """`api_servers` as `serve` runs it: as set, or (unset) 1 where this process may use 2 CPUs or more —
        the engine core's process then runs beside the frontend's — and 0 on one CPU."""
        if self.api_servers is not None:
            return self.api_servers
        from .engine.cpu_threads import usable_cpus

        return 1 if usable_cpus() >= 2 else 0


def describe_invalid(error: ValidationError, path: Path | None) -> str:
    """One line per bad value, naming the setting the way a user sets it: flag, LINSERVE_ variable, file key."""
    lines = []
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else "?"
        where = f"--{name.replace('_', '-')}, {Settings.model_config['env_prefix']}{name.upper()}"
        where += f" or '{name}' in {path}" if path is not None else ""
        if problem["type"] == "extra_forbidden":
            lines.append(f"unknown setting '{name}'" + (f" in {path}" if path is not None else ""))
        else:
            lines.append(f"invalid {name} ({where}): {problem['msg']}, got {problem.get('input')!r}")
    return "; ".join(lines)
