"""Batched sampling on the device, as pure functions of logits and per-row parameter tensors.

Every row's parameters live in per-slot tensors (`SlotSampling`, written once when a row is admitted), so a
step gathers them with the row's slot index — inside the compiled decode program or eagerly — instead of
building them from Python objects each step.

Randomness is counter-based: a row's uniform number for the token at absolute position p is a hash of
(its seed, p) (`counter_uniforms`), so a seeded request samples the same tokens whatever else shares its
batch, whichever step runs it, and a session continued with the same seed draws what one long request
would have drawn. The choice is inverse-CDF over the (filtered) distribution: no batch-wide random draw.
"""

from __future__ import annotations

import math

import torch

from linserve.model import kernels

from .types import SamplingParams, TokenLogprob

MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays inside int64, so the hash is exact in any
# backend (no overflow), and the low 32 bits mix as in the usual multiply-xorshift finalizers
MIX = (0x7FEB352D, 0x2C1B3C6D)


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche of 32-bit values held in int64 (B,)."""
    for multiplier in MIX:
        h = h ^ (h >> 16)
        h = (h * multiplier) & MASK32
    return h ^ (h >> 15)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seeds (B,) int64 (any value), positions (B,) int64 in [0, 2**32) → uniforms (B,) fp32 in [0, 1),
    24 bits each. A pure function of (seed, position): no generator state, no dependence on the batch."""
    h = _mix32((seeds & MASK32) ^ 0x1B873593)  # (B,) the seed's low half
    h = _mix32(h ^ ((seeds >> 32) & MASK32))  # its high half
    h = _mix32(h ^ (positions & MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))  # (B,)


class SlotSampling:
    """Per-slot sampling parameters and penalty statistics on the device, one row per state slot."""

    FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    TENSORS = ("floats", "top_k", "seed", "bias", "counts", "seen")  # `tensors()`, in the programs' order

    def __init__(self, num_slots: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.floats = torch.zeros(len(self.FLOATS), num_slots, device=device)  # (6, N) in FLOATS order
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)  # (N,)
        self.seed = torch.zeros(num_slots, dtype=torch.long, device=device)  # (N,)
        self.bias = torch.zeros(num_slots, vocab, device=device)  # (N, V) logit_bias, dense
        self.counts = torch.zeros(num_slots, vocab, device=device)  # (N, V) generated-token counts
        self.seen = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)  # (N, V) history or prompt

    def assign(self, slot: int, params: SamplingParams, seed: int, seen: torch.Tensor | None,
               prompt_ids: list[int]) -> None:
        """Set a slot's row for a new request: its parameters, seed, bias, and fresh penalty statistics
        (`seen`: a session's history (V,) bool, then the prompt's tokens)."""
        self.floats[:, slot] = param_floats([params], self.device)[:, 0]
        self.top_k[slot] = params.top_k
        self.seed[slot] = seed
        self.bias[slot].zero_()
        if params.logit_bias:
            ids = torch.tensor([token for token, _ in params.logit_bias], device=self.device)
            self.bias[slot, ids] = torch.tensor([bias for _, bias in params.logit_bias], device=self.device)
        self.counts[slot].zero_()
        if seen is not None:
            self.seen[slot].copy_(seen)
        else:
            self.seen[slot].zero_()
        if prompt_ids:
            self.seen[slot, torch.tensor(prompt_ids, device=self.device)] = True

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """A slot's row, copied out (a preempted row keeps it while it waits for a slot again)."""
        return {"floats": self.floats[:, slot].clone(), "top_k": self.top_k[slot].clone(),
                "seed": self.seed[slot].clone(), "bias": self.bias[slot].clone(),
                "counts": self.counts[slot].clone(), "seen": self.seen[slot].clone()}

    def load(self, slot: int, row: dict[str, torch.Tensor]) -> None:
        self.floats[:, slot] = row["floats"]
        for name in ("top_k", "seed", "bias", "counts", "seen"):
            getattr(self, name)[slot] = row[name]

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just chosen for `slots` (B,) (penalties and a session's history; a generated token
        counts as seen through its count). The decode program counts its own draws (decode_program)."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=self.counts.dtype), accumulate=True)

    def unrecord(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Take back counts of tokens that were never delivered (a step that failed after counting them)."""
        self.counts.index_put_((slots, tokens), -torch.ones_like(tokens, dtype=self.counts.dtype), accumulate=True)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the decode program reads, in `choose_tokens`' order after its first three arguments."""
        return tuple(getattr(self, name) for name in self.TENSORS)


def process_logits(logits: torch.Tensor, floats: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor,
                   seen: torch.Tensor) -> torch.Tensor:
    """logits (B, V) + logit_bias, then repetition (over seen), frequency and presence (over generated)
    penalties; floats (6, B) in SlotSampling.FLOATS order. Neutral parameters leave a logit exactly as it was."""
    rep, presence, frequency = floats[3][:, None], floats[4][:, None], floats[5][:, None]  # (B, 1) each
    logits = logits + bias  # (B, V)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)  # (B, V)
    logits = torch.where(seen | (counts > 0), penalised, logits)  # (B, V) seen: history and prompt, or generated
    logits = logits - frequency * counts  # (B, V)
    return logits - presence * (counts > 0).to(logits.dtype)  # (B, V)


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                    params: list[SamplingParams]) -> torch.Tensor:
    """`process_logits` for rows described by SamplingParams (tests, tools), without logit_bias."""
    return process_logits(logits, param_floats(params, logits.device), torch.zeros_like(logits), counts, seen)


def param_floats(params: list[SamplingParams], device: torch.device | str = "cpu") -> torch.Tensor:
    """(6, B) in SlotSampling.FLOATS order."""
    return torch.tensor([[float(getattr(p, name)) for p in params] for name in SlotSampling.FLOATS], device=device)


TOP_K_IN_PROGRAM = 64  # top-k drawn inside the decode program up to this k (HF's default 50 included)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """weights (B, V) ≥ 0 → the index where each row's cumulative weight first exceeds u × total (B,)."""
    cdf = weights.cumsum(dim=-1)  # (B, V)
    target = uniforms[:, None] * cdf[:, -1:]  # (B, 1)
    return torch.searchsorted(cdf, target, right=True).clamp(max=weights.shape[-1] - 1)[:, 0]  # (B,)


def _tempered(processed: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax (B,), the weights of softmax(logits / T) (B, V) in float64, unnormalised: exp(scaled − max), the
    largest 1); rows with temperature 0 get T = 1 (their argmax is used). Every draw here is the same whatever the
    weights' scale (inverse CDF, top-k, min-p against the largest; top-p against the sum), so the sum over the
    vocabulary is taken only where top-p needs it. The exponentials are float64 (the eager and the compiled
    program's exp differ in fp32's last bit, enough to move an inverse-CDF draw across a boundary; in float64 the
    difference is ~1e-16), and a CPU's are SLEEF's vector exp, the decode program's kernel's too."""
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))  # (B,)
    scaled = processed / scale[:, None]  # (B, V)
    return processed.argmax(dim=-1), torch.exp((scaled - scaled.amax(dim=-1, keepdim=True)).double())  # (B,), (B, V)


def sample_plain(processed: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """processed (B, V) → tokens (B,): argmax where temperature is 0, else a draw from softmax(logits / T)
    — no top-k/top-p/min-p filter (no sort): the decode program's path."""
    greedy, weights = _tempered(processed, temperature)  # (B,), (B, V)
    return torch.where(temperature > 0, _inverse_cdf(weights, uniforms), greedy)  # (B,)


def sample_filtered(processed: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`sample_plain` with each row's top-k (0: off), top-p and min-p filters (B,), decided over the sorted
    distribution (the most likely token always survives); the draw itself is inverse-CDF in vocabulary
    order over the survivors, so a row whose filters drop nothing gets exactly `sample_plain`'s token."""
    greedy, weights = _tempered(processed, temperature)  # (B,), (B, V)
    vocab = weights.shape[-1]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)  # (B,)
    if bool((top_p < 1).any()):
        chosen = _inverse_cdf(weights.masked_fill(_dropped_by_sort(weights, k, top_p, min_p), 0.0), uniforms)  # (B,)
    else:
        chosen = _draw_top_k(weights, k, min_p, uniforms)  # (B,)
    return torch.where(temperature > 0, chosen, greedy)  # (B,)


def _draw_top_k(weights: torch.Tensor, k: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Top-k and min-p without a sort of the vocabulary (k in [1, V]): the inverse-CDF draw over each row's
    survivors alone, in vocabulary order (`_draw_survivors`)."""
    return _draw_survivors(weights, k, min_p, uniforms, min(int(k.max()), weights.shape[-1]))  # (B,)


def _draw_survivors(weights: torch.Tensor, k: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor,
                    width: int) -> torch.Tensor:
    """The draw over each row's top-k survivors (k (B,) in [1, width]; ties at the k-th value broken toward the
    lower id, as a stable descending sort ranks them), less those min-p drops, gathered into a window of `width`
    in vocabulary order: the same additions in the same order as the inverse CDF over the whole masked row (a
    dropped token adds an exact zero there), so the same token to the bit, also where the draw runs past the last
    survivor (id V - 1, as `_inverse_cdf` clamps). No branch and static shapes: the decode program's form too."""
    vocab = weights.shape[-1]
    kth = weights.topk(width, dim=-1).values.gather(1, (k - 1)[:, None])  # (B, 1) each row's k-th largest value
    floor = min_p[:, None] * weights.amax(dim=-1, keepdim=True)  # (B, 1) min-p, against the largest
    keep = ~_outside_top_k(weights, k, kth) & (weights >= floor)  # (B, V)
    order = torch.arange(vocab, 0, -1, device=weights.device)  # (V,) larger for lower ids
    ranked, at_id = torch.where(keep, order[None, :], torch.zeros_like(order)[None, :]).topk(width, dim=-1)  # (B, W)
    ids = vocab - ranked  # (B, W) the survivors in vocabulary order, then filler (ranked 0)
    values = torch.where(ranked > 0, weights.gather(1, at_id),
                         torch.zeros((), dtype=weights.dtype, device=weights.device))  # (B, W)
    cdf = values.cumsum(dim=-1)  # (B, W)
    at = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)  # (B, 1)
    token = ids.gather(1, at.clamp(max=width - 1))[:, 0]  # (B,)
    return torch.where(at[:, 0] < width, token, torch.full_like(token, vocab - 1))  # (B,)


def _dropped_by_sort(weights: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """The filters over each row's whole sorted distribution (top-p needs the mass before every rank, as a share
    of the row's total): (B, V) bool in vocabulary order. The most likely token (the lowest id among equals)
    always survives."""
    ordered, order = weights.sort(dim=-1, descending=True, stable=True)  # (B, V)
    ranks = torch.arange(weights.shape[-1], device=weights.device)[None, :]  # (1, V)
    cumulative = ordered.cumsum(dim=-1)  # (B, V)
    drop = ranks >= k[:, None]  # (B, V) in sorted order
    drop |= cumulative - ordered >= top_p[:, None] * cumulative[:, -1:]  # mass strictly before each rank
    drop |= ordered < min_p[:, None] * ordered[:, :1]
    drop[:, 0] = False
    return torch.zeros_like(drop).scatter(1, order, drop)  # (B, V) back in vocabulary order


def _outside_top_k(weights: torch.Tensor, k: torch.Tensor, kth: torch.Tensor | None = None) -> torch.Tensor:
    """Without top-p no sort is needed: (B, V) True where a token is not among its row's k most likely, ties at
    the k-th value broken toward the lower id — exactly the ranks a stable descending sort gives (k in [1, V]).
    `kth` (B, 1): each row's k-th largest value, if the caller has it."""
    if kth is None:
        kth = weights.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # (B, 1)
    above = weights > kth  # (B, V)
    level = weights == kth  # (B, V)
    room = k[:, None] - above.sum(dim=-1, keepdim=True)  # (B, 1) >= 1: how many at the k-th value survive
    return ~(above | (level & (level.cumsum(dim=-1) <= room)))  # (B, V)


def _draw_in_program(processed: torch.Tensor, temperature: torch.Tensor, window: torch.Tensor, min_p: torch.Tensor,
                     uniforms: torch.Tensor) -> torch.Tensor:
    """The decode program's draw in torch's ops (static shapes): argmax where temperature is 0; else window (B,) > 0
    — the top-k (and min-p) draw over a fixed width (TOP_K_IN_PROGRAM; `_draw_top_k`'s token: the survivors are the
    same and a wider window only adds exact zeros to the cumulative sum); 0 — no filter, the inverse CDF over the
    whole row. On a CPU `choose_tokens` draws in one pass a row instead (kernels/sampling.cpp, the weights of the
    top-k's candidates alone; the op `tempered_draw` is that draw by itself): the same tokens to the bit."""
    greedy, weights = _tempered(processed, temperature)  # (B,), (B, V)
    width = min(TOP_K_IN_PROGRAM, weights.shape[-1])
    filtered = _draw_survivors(weights, window.clamp(min=1, max=width), min_p, uniforms, width)  # (B,)
    drawn = torch.where(window > 0, filtered, _inverse_cdf(weights, uniforms))  # (B,)
    return torch.where(temperature > 0, drawn, greedy)  # (B,)


def uses_filters(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """(B,) bool: rows with top-k, top-p or min-p — SamplingParams.uses_filters for a sampled row."""
    return (top_k > 0) | (top_p < 1) | (min_p > 0)


def count_tokens(counts: torch.Tensor, slots: torch.Tensor, tokens: torch.Tensor, counted: torch.Tensor) -> None:
    """One more of each row's token in its slot's counts (N, V), for the rows `counted` (B,) bool — in place, one
    write a row (not an accumulation): rows padded to a bucket repeat the first row and write the same value."""
    current = counts[slots, tokens]  # (B,)
    counts.index_put_((slots, tokens), torch.where(counted, current + 1, current))


def choose_tokens(logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, floats: torch.Tensor,
                  top_k: torch.Tensor, seed: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor,
                  seen: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The sampling half of a decode program: logits (B, V) of the rows in `slots` (B,), their token
    positions (B,), and the SlotSampling tensors →
    (tokens (B,), finite (B,) bool, uniforms (B,), processed (B, V), redraw (B,) bool).
    tokens: argmax for greedy rows, the top-k (and min-p) draw for rows with top-k up to TOP_K_IN_PROGRAM and no
    top-p, the unfiltered draw for the rest; `redraw` marks the sampled rows with filters this program could not
    apply (top-p, larger k, min-p alone): the caller redraws them from `processed` with
    the same uniforms (`sample_filtered`, the same token where both apply). Rows with non-finite logits sample
    from zeros (their requests fail). Log-probabilities are the host's, for the rows that ask (`token_logprobs`).
    On a CPU one pass a row (kernels/sampling.cpp), the same outputs to the bit; elsewhere torch's ops."""
    if logits.device.type == "cpu" and kernels.load():
        return tuple(torch.ops.linserve.choose_tokens(logits, slots, positions, floats, top_k, seed, bias, counts,
                                                      seen))
    finite = torch.isfinite(logits).all(dim=-1)  # (B,)
    logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))  # (B, V)
    row_floats = floats.index_select(1, slots)  # (6, B)
    processed = process_logits(logits, row_floats, bias.index_select(0, slots), counts.index_select(0, slots),
                               seen.index_select(0, slots))  # (B, V)
    uniforms = counter_uniforms(seed.index_select(0, slots), positions)  # (B,)
    temperature, top_p, min_p = row_floats[0], row_floats[1], row_floats[2]  # (B,) each
    k = top_k.index_select(0, slots)  # (B,)
    filters = uses_filters(k, top_p, min_p)  # (B,)
    window = torch.where(filters, k.clamp(min=1, max=TOP_K_IN_PROGRAM), torch.zeros_like(k))  # (B,) 0: whole row
    tokens = _draw_in_program(processed, temperature, window, min_p, uniforms)  # (B,)
    cannot = (k <= 0) | (k > TOP_K_IN_PROGRAM) | (top_p < 1)  # (B,) top-p, a larger k, min-p alone
    redraw = (temperature > 0) & filters & cannot  # (B,)
    return tokens, finite, uniforms, processed, redraw


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token the model gives (almost) no mass


def json_safe_logprob(value: float) -> float:
    """Log-probabilities leave the engine finite: -inf (or NaN) becomes the floor, so JSON never sees them."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int | None]) -> list[TokenLogprob | None]:
    """Log-probabilities of the model's distribution (before penalties and temperature) for rows that ask."""
    wanted = [i for i, n in enumerate(top_n) if n is not None]
    if not wanted:
        return [None] * len(top_n)
    rows = torch.tensor(wanted, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)  # (b, V)
    chosen = logp.gather(1, tokens.index_select(0, rows)[:, None])[:, 0].tolist()  # (b,)
    widest = max(top_n[i] for i in wanted)
    top_values, top_ids = logp.topk(max(widest, 1), dim=-1)  # (b, N)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = [None] * len(top_n)
    for j, i in enumerate(wanted):
        n = top_n[i]
        alternatives = tuple((t, json_safe_logprob(v)) for t, v in zip(top_ids[j][:n], top_values[j][:n]))
        out[i] = TokenLogprob(token_id=int(tokens[i]), logprob=json_safe_logprob(chosen[j]), top=alternatives)
    return out
