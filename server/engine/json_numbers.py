"""Finite numbers in constrained JSON: every number a JSON schema lets the model write reads as a finite double.

llguidance's JSON grammar takes a number's digits and exponent without bound (its number lexeme is fixed), and a
sampled answer can be valid JSON whose number is `1.1E231151611111211111111182111511` — Python reads it as `inf`,
JavaScript as `Infinity`. A row under a JSON grammar (json_schema, json_object) also carries a `NumberGuard`: a
small lexer over the text the row has written (outside strings, in a number's integer part, fraction or
exponent) that forbids, at each step, the tokens that would make a number's integer part longer than
MAX_INT_DIGITS digits or its exponent larger than MAX_EXPONENT (at most MAX_EXP_DIGITS digits). The largest
number left is below 10^19 · 10^288 = 10^307 < 1.8·10^308: finite; one that small underflows to 0, also finite.

The token texts are lexed once per tokenizer from each state that does not carry a count (`NumberTables`), and
the counted states (digits so far in an integer part or an exponent) combine a token's leading digit run with the
rest of it, so a step's mask is a few vector operations over the vocabulary, never a loop over it.
"""

from __future__ import annotations

import torch

MAX_INT_DIGITS = 19  # every int64 fits
MAX_EXP_DIGITS = 3
MAX_EXPONENT = 288

OUT, STRING, ESCAPE, INT, FRACTION, EXP_SIGN, EXP = range(7)  # lexer states (INT, EXP carry counts)
State = tuple[int, int, int]  # (state, digits so far, exponent value so far)
START: State = (OUT, 0, 0)


def lex(state: State, text: str) -> State | None:
    """The lexer's state after `text` from `state`; None if a number in it breaks the bounds."""
    kind, digits, value = state
    for char in text:
        if kind == STRING:
            kind = ESCAPE if char == "\\" else OUT if char == '"' else STRING
            continue
        if kind == ESCAPE:
            kind = STRING
            continue
        if kind == INT:
            if char.isdigit() and char.isascii():
                digits += 1
                if digits > MAX_INT_DIGITS:
                    return None
                continue
            if char == ".":
                kind = FRACTION
                continue
            if char in "eE":
                kind, digits, value = EXP_SIGN, 0, 0
                continue
            kind = OUT  # the number ended: this character is structure
        elif kind == FRACTION:
            if char.isdigit() and char.isascii():
                continue
            if char in "eE":
                kind, digits, value = EXP_SIGN, 0, 0
                continue
            kind = OUT
        elif kind in (EXP_SIGN, EXP):
            if char.isdigit() and char.isascii():
                kind, digits, value = EXP, digits + 1, value * 10 + int(char)
                if digits > MAX_EXP_DIGITS or value > MAX_EXPONENT:
                    return None
                continue
            if kind == EXP_SIGN and char in "+-":
                continue
            kind = OUT
        if char == '"':  # OUT
            kind = STRING
        elif char == "-" or (char.isdigit() and char.isascii()):
            kind, digits, value = INT, int(char != "-"), 0
    return kind, digits, value


class NumberTables:
    """Per tokenizer: for each token, whether it breaks the bounds from each uncounted state, and the pieces
    that decide it from a counted one (its leading digits, their value, whether the rest breaks them)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        lead = [len(t) - len(t.lstrip("0123456789")) for t in texts]
        self.lead = torch.tensor(lead)  # (V,) leading ASCII digits
        self.lead_value = torch.tensor([int(t[: min(n, 4)] or 0) for t, n in zip(texts, lead)])  # (V,) ≤ 9999
        self.bad = {kind: self._bad(lambda t, k=kind: lex((k, 0, 0), t)) for kind in (OUT, STRING, ESCAPE, FRACTION,
                                                                                      EXP_SIGN)}
        self.binds = {kind: bool(bad.any()) for kind, bad in self.bad.items()}  # (most states forbid nothing)
        # the rest after the leading digits (which begins with something else: the count no longer matters)
        self.rest_bad_int = self._bad(lambda t, n: lex((INT, 1, 0), t[n:]), with_lead=True)
        self.rest_bad_exp = self._bad(lambda t, n: lex((EXP, 1, 0), t[n:]), with_lead=True)

    def _bad(self, run, with_lead: bool = False) -> torch.Tensor:
        lead = self.lead.tolist()
        return torch.tensor([(run(t, n) if with_lead else run(t)) is None for t, n in zip(self.texts, lead)])

    def allowed(self, state: State) -> torch.Tensor | None:
        """(V,) bool: the tokens that keep every number within bounds from `state`; None: every token does."""
        kind, digits, value = state
        if kind == INT:
            bad = (self.lead + digits > MAX_INT_DIGITS) | self.rest_bad_int
        elif kind == EXP:
            scale = torch.pow(10, self.lead.clamp(max=4))  # (V,)
            bad = (self.lead + digits > MAX_EXP_DIGITS) | (value * scale + self.lead_value > MAX_EXPONENT)
            bad |= self.rest_bad_exp
        else:
            if not self.binds[kind]:
                return None
            bad = self.bad[kind]
        return ~bad


class NumberGuard:
    """One row's lexer state over what it has written."""

    def __init__(self, tables: NumberTables) -> None:
        self.tables, self.state = tables, START

    def accept(self, token: int) -> None:
        if 0 <= token < len(self.tables.texts):
            self.state = lex(self.state, self.tables.texts[token]) or START  # (a forced closing token: start over)

    def allowed(self) -> torch.Tensor | None:
        return self.tables.allowed(self.state)
