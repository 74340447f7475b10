"""The model card and the utilities' request and response models (tokenize, detokenize, tokenizer info,
version)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    model_validator,
)

from ..common.chat import ChatMessage
from ..common.protocol import Int, Text


class TokenizeRequest(BaseModel):
    """`prompt` (text) or `messages` (a chat, rendered as /v1/chat/completions does), not both."""

    model_config = ConfigDict(extra="forbid")
    prompt: Text = ""
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    model: Text | None = None
    add_special_tokens: StrictBool = Field(True, description="vLLM's field: the tokenizer's bos before the text "
                                                              "(where it adds one), as a request starting a "
                                                              "sequence gets it")

    @model_validator(mode="after")
    def _one_of(self):
        if self.messages is not None and self.prompt:
            raise ValueError("give either prompt or messages, not both")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[Int] = Field(max_length=1_000_000)
    model: Text | None = None


# ---------------------------------------------------------------- responses
class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_prompt_tokens: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """The tokenizer as vLLM's `/tokenizer_info` describes it (lm-evaluation-harness's remote tokenizer)."""

    model_config = ConfigDict(protected_namespaces=())  # `model_max_length` is the field's name (pydantic < 2.10 warns)

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    vocab_size: int
    checkpoint_vocab_size: int | None = None  # config.json's; larger when padded past the tokenizer (never served)
    model_max_length: int  # max_prompt_tokens: the model itself has no context limit
    chat_template: str | None


class VersionInfo(BaseModel):
    version: str
    torch: str
    transformers: str
    device: str | None = None  # None while the model loads
    threads: int = Field(description="torch's intra-op CPU threads of the engine (the compiled CPU kernels are "
                         "built for this count)")
    cpu_threads: dict | None = Field(None, description="how the thread count was chosen: threads, usable_cpus "
                                     "(affinity mask and cgroup quota), source (setting or default), omp_wait_policy")
    dtype: str | None = Field(None, description="the weights' dtype of every form — prefill, decode steps, "
                              "verification (the (S, z) state is fp32 whatever it is)")
    projections: dict | None = Field(None, description="how the projections run: kernel (amx, avx512bf16, avx512 or "
                                     "scalar: linserve's batch-invariant kernel; onednn without it) and weights "
                                     "(bf16 or int8)")
    decode_step: dict | None = Field(None, description="compile setting, status, buckets ready and compile=auto's "
                                     "verdict (decision, gain, quartiles, rounds, contention, provisional, source)")
    api_servers: int = Field(description="where the engine runs: 0, a thread of the HTTP process; N >= 1, the engine "
                             "core in a process of its own with N frontend processes")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "linserve"
    root: str | None = Field(None, description="the checkpoint directory served")
    model_type: str | None = Field(None, description="the checkpoint's family: linear_gpt, linear_attn, gla, retnet")
    state_bytes: int | None = Field(None, description="bytes of one session's state, whatever its length")
    vocab_size: int | None = Field(None, description="the served vocabulary: the tokenizer's ids, every one the model "
                                   "can emit")
    checkpoint_vocab_size: int | None = Field(None, description="the checkpoint's vocab_size (config.json): larger "
                                              "when padded past the tokenizer — those ids are never served")
    generation_defaults: dict | None = Field(None, description="what the checkpoint's generation_config.json sets "
                                             "(setting generation_config: auto): its file, end-of-text ids and the "
                                             "defaults of a request that leaves those fields out")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
