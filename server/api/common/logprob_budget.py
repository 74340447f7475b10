"""Memory that logprobs take while a request is in flight, bounded and counted.

Scoring a prompt (`echo` + `logprobs`) keeps one entry per prompt token, with its top-N alternatives, until
the response is written; a non-streamed response keeps every generated token's too. Measured on the
shipped model (32,000-token prompt, `max_tokens: 0`, peak RSS growth of the serving process): about 2.3 KB
per token with no alternatives and about 0.25 KB per alternative (7 KB per token at top 20). A request's
need is estimated from that before it is admitted; the in-flight total stays under `logprobs_memory_mb`.
A request that could never fit is a 400 naming the limit, one that does not fit beside the others a 429
with Retry-After. The reservation is held until the response has been sent.
"""

from __future__ import annotations

import threading

from ...engine import SamplingParams
from .errors import APIError

BYTES_PER_TOKEN = 2560  # one scored token's entry, whatever N (measured 2.3 KB; see the module doc)
BYTES_PER_ALTERNATIVE = 300  # each of its top-N alternatives (measured 0.25 KB)


def logprob_bytes(prompt_tokens: list[int], params: SamplingParams, streamed: bool) -> int:
    """The estimated peak bytes of a request's logprobs: scored prompts (each choice carries its prompt's)
    and, when not streamed, every generated token's (a stream writes them as they come)."""
    per_token = BYTES_PER_TOKEN + BYTES_PER_ALTERNATIVE * (params.logprobs or 0)
    tokens = 0
    if params.prompt_logprobs is not None:
        tokens += sum(prompt_tokens) * params.n
    if params.logprobs is not None and not streamed:
        tokens += len(prompt_tokens) * params.n * params.max_tokens
    return tokens * per_token


class Reservation:
    def __init__(self, budget: LogprobBudget | None, nbytes: int) -> None:
        self._budget, self.nbytes = budget, nbytes

    def release(self) -> None:
        """Give the bytes back (idempotent)."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.nbytes)


class LogprobBudget:
    def __init__(self, limit_bytes: int, retry_after_s: int) -> None:
        self.limit = limit_bytes
        self.retry_after_s = retry_after_s
        self.in_use = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> Reservation:
        if nbytes == 0:
            return Reservation(None, 0)
        limit_mb = self.limit / 2**20
        if nbytes > self.limit:
            raise APIError(400, f"the logprobs of this request would take about {nbytes / 2**20:.0f} MB, more than "
                           f"logprobs_memory_mb ({limit_mb:g} MB) allows: score fewer or shorter prompts, ask "
                           "for fewer top_logprobs, or stream", "logprobs", code="logprobs_too_large")
        with self._lock:
            if self.in_use + nbytes > self.limit:
                raise APIError(429, f"the logprobs of requests in flight fill logprobs_memory_mb ({limit_mb:g} MB; "
                               f"this one needs about {nbytes / 2**20:.0f} MB): retry later", "logprobs",
                               code="logprobs_memory_full", headers={"Retry-After": str(self.retry_after_s)})
            self.in_use += nbytes
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self.in_use -= nbytes
