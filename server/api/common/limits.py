"""What one request may ask of this server, in one place. Each rule is checked once:

- the body's own shape and ranges: the family's request model (pydantic, its `protocol.py`), 400 with `param`;
- the body against this server's settings (max_tokens, speculative.k, priority, prompt length, batch size,
  chat messages): `RequestLimits`, called by the family when its request converts itself to engine input —
  the family knows which field the client named (`max_tokens`, `max_completion_tokens`, `max_output_tokens`);
- what depends on the model and the engine's state (token ids and logit_bias against the vocabulary, top_k,
  n against the slots, the queue, a session's claim): the engine, when it accepts the request
  (`engine/accounting.check_request`, `core._accept`) — the one check for HTTP and in-process callers alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...engine import SamplingParams
from ...generation_defaults import GenerationDefaults
from .errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    """The settings and tokenizer facts requests are checked against (built once the model is loaded)."""

    max_tokens: int  # a request's max_tokens at most (settings.max_tokens_limit)
    default_max_tokens: int  # when a request names none (settings.max_tokens_default)
    speculative_k: int
    scheduling_policy: str
    max_prompt_tokens: int
    max_prompts: int  # prompts in one completions batch
    max_chat_messages: int
    max_token_bytes: int  # the most UTF-8 bytes one token decodes to: B bytes of text are ≥ B / this tokens
    prompt_prefix: tuple[int, ...]  # what the tokenizer puts before a text that starts a sequence ([bos] or ())
    generation: GenerationDefaults = GenerationDefaults()  # the checkpoint's defaults (generation_defaults.py)

    @classmethod
    def of(cls, settings, tokenizer, generation: GenerationDefaults | None = None) -> RequestLimits:
        generation = generation or GenerationDefaults()
        default_max_tokens = settings.max_tokens_default  # an operator's own setting wins over the checkpoint's
        if generation.max_tokens is not None and "max_tokens_default" not in settings.model_fields_set:
            default_max_tokens = min(generation.max_tokens, settings.max_tokens_limit)
        return cls(settings.max_tokens_limit, default_max_tokens, settings.speculative_k,
                   settings.scheduling_policy, settings.max_prompt_tokens, settings.max_prompts_per_request,
                   settings.max_chat_messages, max_token_bytes(tokenizer), tuple(prompt_prefix(tokenizer)),
                   generation)

    def sampling_default(self, request, name: str):
        """`request.<name>` if the client sent it, else the checkpoint's default, else the request model's."""
        return self.generation.value(name, name in request.model_fields_set, getattr(request, name))

    def max_tokens_of(self, field: str, value: int | None) -> int:
        """A request's token budget named by `field` (the default when absent), within max_tokens_limit."""
        if value is None:
            return self.default_max_tokens
        if value > self.max_tokens:
            raise APIError(400, f"{field} must be <= {self.max_tokens}", field)
        return value

    def check_sampling(self, params: SamplingParams) -> SamplingParams:
        """The options whose bounds are this server's: a priority only under the priority policy, speculative.k
        within the server's speculative_k."""
        if params.priority and self.scheduling_policy != "priority":
            raise APIError(400, "priority is honoured only with scheduling_policy: priority (this server: "
                           f"{self.scheduling_policy}); send 0 or leave it out", "priority")
        wanted_k = params.speculative.k if params.speculative is not None else None
        if wanted_k is not None and wanted_k > self.speculative_k:
            raise APIError(400, f"speculative.k must be <= {self.speculative_k} (this server's speculative_k)",
                           "speculative")
        return params

    def check_prompt_bytes(self, text_bytes: int, what: str, param: str) -> None:
        """A text longer in bytes than any text of max_prompt_tokens tokens, refused before tokenizing."""
        if text_bytes > self.max_prompt_tokens * self.max_token_bytes:
            raise APIError(400, f"the {what} is longer than max_prompt_tokens ({self.max_prompt_tokens} tokens)",
                           param, "prompt_too_long")

    def check_prompt_tokens(self, count: int) -> None:
        if count > self.max_prompt_tokens:
            raise APIError(400, f"the prompt is longer than max_prompt_tokens ({self.max_prompt_tokens} tokens): "
                           f"it has {count}", "prompt", "prompt_too_long")

    def check_batch(self, prompts: int, session: bool) -> None:
        if session and prompts > 1:
            raise APIError(400, "a session continues with one prompt, not a batch", "prompt")
        if prompts > self.max_prompts:
            raise APIError(400, f"a batch holds at most {self.max_prompts} prompts (max_prompts_per_request), "
                           f"got {prompts}", "prompt")

    def check_chat_messages(self, count: int) -> None:
        if count > self.max_chat_messages:
            raise APIError(400, f"a chat may have at most {self.max_chat_messages} messages, got {count}",
                           "messages", "too_many_messages")


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any one token decodes to: a text of B bytes has at least B / this many tokens."""
    return max(len(tokenizer.decode([i]).encode()) for i in range(len(tokenizer)))


def prompt_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts before a text that starts a sequence: [bos] where it adds one (Llama-style
    `add_bos_token`, as most fla checkpoints' tokenizers do), else none (the shipped byte-level BPE)."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    return ids[:1] if ids and bos is not None and ids[0] == bos else []
