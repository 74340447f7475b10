"""Constrained decoding: a grammar (JSON schema, regex, choice, Lark) decides which tokens may come next.

The engine is llguidance (see docs/http-api.md for why: no dependencies, JSON schema / regex / Lark natively,
~10-30 µs per mask on this vocabulary, matchers that copy and roll back). The decode step sees one thing: a
constrained row's logit-bias row (`SlotSampling.bias`, an input of the compiled decode program) holds -inf
for every token the grammar forbids, so sampling, penalties and filters need no other change. After each
accepted token the row's `GrammarConstraint` advances its matcher and writes the next mask — a packed bitmask
unpacked by tensor ops, never a Python loop over the vocabulary.

The token budget is part of the constraint: once the tokens left are just enough for the shortest way found
to close the open structure, only that way's tokens are allowed, so an output that fits `max_tokens` is
complete and valid. The shortest way is searched over single-character tokens (greedy walks in a few orders
of preference: close a string, an object, an array, write a digit …): an upper bound, found in well under
a millisecond, computed only near the end of the budget.
"""

from __future__ import annotations

import string

import torch

from .grammar import Grammar, GrammarCompiler
from .json_numbers import NumberGuard, NumberTables

CLOSING_ORDERS = ('"}]0', '}]"0')  # preferences of the greedy closing walks (then any character)
CLOSE_MARGIN = 6  # the most one token can lengthen the way (a `\\u` escape needs 4 hex digits and a quote)
NEARLY_FORCED = 16  # this few tokens allowed: a forced word, taken in its longest token
# then any character, punctuation first (it moves a pattern on: `@`, `.`, `-`), digits, space, letters
CLOSING_CHARS = '"}],:@.-_/+#!?;=&%$*<>|~^`\'()[{\\' + '0123456789 ' + string.ascii_lowercase + string.ascii_uppercase
WATCH_TOKENS = 64  # the closing way is first measured once this few tokens are left
MAX_CLOSING = 80  # a longer closing way is not searched for (the row ends with "length")


class GrammarRuntime(GrammarCompiler):
    """The compiler (grammar.py) and what the engine's masks need besides: the single-character tokens of the
    closing search and each token's length (one per engine; built lazily, at the first constrained request)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self.char_tokens: dict[str, int] = {}
        for char in CLOSING_CHARS:
            ids = tokenizer.encode(char, add_special_tokens=False)
            if len(ids) == 1:
                self.char_tokens[char] = ids[0]
        words = (vocab_size + 31) // 32
        self.shifts = torch.arange(32, dtype=torch.int32)  # (32,)
        texts = [tokenizer.decode([i]) for i in range(vocab_size)]
        self.token_chars = torch.tensor([len(text) for text in texts])  # (V,)
        self.numbers = NumberTables(texts)  # (JSON grammars' bound on numbers)
        self.words = words

    def matcher(self, grammar: Grammar):
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar.source)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher


def write_rows(constraints: list[GrammarConstraint], bias_rows: torch.Tensor, remaining: list[int]) -> torch.Tensor:
    """The next masks of a step's constrained rows as their bias rows (R, V): the request's logit_bias where the
    grammar allows, -inf elsewhere — unpacked and written for all rows at once. Returns the rows written."""
    runtime = constraints[0].runtime
    masks = torch.stack([c.next_mask(left) for c, left in zip(constraints, remaining)])  # (R, V/32)
    allowed = ((masks[:, :, None] >> runtime.shifts) & 1).reshape(len(constraints), -1)  # (R, V/32 * 32)
    allowed = allowed[:, : runtime.vocab_size].bool()  # (R, V)
    for row, constraint in enumerate(constraints):  # JSON: numbers kept finite, unless nothing else is left
        bounded = constraint.numbers_allowed()
        if bounded is not None and bool((allowed[row] & bounded).any()):
            allowed[row] &= bounded
    allowed = allowed.to(bias_rows.device)
    bases = torch.stack([c.base for c in constraints]).to(bias_rows.device)  # (R, V)
    bias_rows.copy_(torch.where(allowed, bases, torch.tensor(float("-inf"), device=bias_rows.device)))
    return bias_rows


class GrammarConstraint:
    """One row's grammar state. `write(bias_row, remaining)` puts the allowed tokens for the next position
    into the row's bias; `accept(token)` advances."""

    def __init__(self, runtime: GrammarRuntime, grammar: Grammar, base_bias: torch.Tensor) -> None:
        import llguidance.torch as lgt

        self.runtime, self.grammar = runtime, grammar
        self.matcher = runtime.matcher(grammar)
        self.base = base_bias.clone()  # (V,) the request's own logit_bias
        self.bitmask = lgt.allocate_token_bitmask(1, runtime.vocab_size)  # (1, V/32) int32
        self.closing: list[int] | None = None  # once forced: the rest of the closing way
        self.check_at = WATCH_TOKENS  # the next `remaining` at which the closing way is measured
        self.numbers = NumberGuard(runtime.numbers) if grammar.finite_numbers else None

    def accept(self, token: int) -> None:
        if self.closing:
            self.closing.pop(0)
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)
        if self.numbers is not None:
            self.numbers.accept(token)

    def numbers_allowed(self) -> torch.Tensor | None:
        """(V,) bool: the tokens that keep the JSON's numbers finite next (None: no bound applies); not while
        forced (a closing way or end-of-text)."""
        if self.numbers is None or self.closing or self.matcher.is_stopped():
            return None
        return self.numbers.allowed()

    def write(self, bias_row: torch.Tensor, remaining: int) -> None:
        """Allowed tokens for the next position into `bias_row` (V,) (-inf elsewhere); `remaining` tokens left,
        this one included. (A step writes all its rows at once: `write_rows`.)"""
        write_rows([self], bias_row[None], [remaining])

    def next_mask(self, remaining: int) -> torch.Tensor:
        """The packed mask (V/32,) int32 of the tokens allowed next, `remaining` tokens left (this one included)."""
        go_on = (self.closing is None and remaining <= WATCH_TOKENS and self.matcher.is_accepting()
                 and not self.matcher.is_stopped())
        if self.closing is None and (remaining <= min(WATCH_TOKENS, self.check_at) or go_on):
            # where the text could end now, what matters is the cheapest way to go on and still end: if even that
            # does not fit, it ends here (a second tool call, another item, is not begun without room to finish).
            # Looked at whenever it could end: going on can need far more than closing did a token before.
            way = self._closing_way(min(remaining, MAX_CLOSING), go_on)
            if go_on and (way is None or len(way) + CLOSE_MARGIN >= remaining):
                self.closing = [self.runtime.eos_id]
            elif way is not None and len(way) + CLOSE_MARGIN >= remaining:
                self.closing = way  # one free token more could make it too long (an escape, half a character)
            # the way grows only as the text opens structures: look again halfway to where it would have to start
            slack = remaining if way is None else remaining - len(way) - CLOSE_MARGIN
            self.check_at = remaining - max(1, slack // 2)
        if self.closing or self.matcher.is_stopped():  # forced: the closing way's next token, or end-of-text
            mask = torch.zeros_like(self.bitmask[0])
            token = self.closing[0] if self.closing else self.runtime.eos_id
            mask[token // 32] = (1 << (token % 32)) - (1 << 32 if token % 32 == 31 else 0)  # int32 bit
            return mask
        import llguidance.torch as lgt

        lgt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        return self.bitmask[0]

    def _closing_way(self, limit: int, go_on: bool = False) -> list[int] | None:
        """The shortest way found to complete the grammar (token ids, end-of-text last), at most `limit`;
        `go_on`: one that does not end at once."""
        best = None
        for order in CLOSING_ORDERS:
            way = self._greedy(order, limit if best is None else len(best) - 1, go_on)
            if way is not None and (best is None or len(way) < len(best)):
                best = way
        return best

    def _greedy(self, order: str, limit: int, go_on: bool = False) -> list[int] | None:
        import llguidance.torch as lgt

        runtime, probe = self.runtime, self.matcher.deep_copy()
        mask = lgt.allocate_token_bitmask(1, runtime.vocab_size)
        closers = [runtime.char_tokens[c] for c in order if c in runtime.char_tokens]
        preference = [runtime.char_tokens[c] for c in CLOSING_CHARS if c in runtime.char_tokens]
        way: list[int] = []
        while len(way) < limit:
            if (way or not go_on) and (probe.is_stopped() or probe.is_accepting()):
                return [*way, runtime.eos_id] if len(way) < limit else None
            forced = probe.compute_ff_tokens()  # what the grammar alone dictates, in its own tokens
            if forced:
                probe.consume_tokens(forced)
                way.extend(forced)
                continue
            lgt.fill_next_token_bitmask(probe, mask, 0)
            if not way and go_on:  # the first token is not end-of-text
                eos = runtime.eos_id
                mask[0, eos // 32] &= ~(1 << (eos % 32))
            allowed = ((mask[0, :, None] >> runtime.shifts) & 1).reshape(-1)[: runtime.vocab_size].nonzero()[:, 0]
            if not len(allowed):
                return None
            row = mask[0]
            token = next((t for t in closers if (int(row[t // 32]) >> (t % 32)) & 1), None)
            if token is None and len(allowed) <= NEARLY_FORCED:  # a key or keyword: its longest token
                token = int(allowed[runtime.token_chars[allowed].argmax()])
            if token is None:
                token = next((t for t in preference if (int(row[t // 32]) >> (t % 32)) & 1), int(allowed[0]))
            probe.consume_token(token)
            way.append(token)
        return None
