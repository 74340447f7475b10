"""A choice's token logprobs released with its text — what completions' and chat's formats share."""

from __future__ import annotations

import collections

from ...engine.types import FinishReason, RequestOutput, TokenLogprob


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


class ChoiceLogprobs:
    """One choice's token logprobs, released with its text — completions' and chat's alike. A token's entry goes
    out once the text it starts in has been returned: a row with stop strings withholds text that may become a
    stop string, and its tokens wait with it; when a stop string ends the row, the tokens that lie wholly inside
    it are dropped (a token straddling it stays: part of its text was returned). So the entries cover exactly
    the returned text, and an entry's offset is a position in the choice's whole returned text, streamed or not.
    What waits is bounded by the longest stop string. Entries are (token_id, TokenLogprob or None, offset)."""

    def __init__(self, tokenizer, start: int = 0) -> None:
        self.tokenizer = tokenizer
        self.returned = start  # characters of the choice's text returned so far
        self.next_at = start  # where the next generated token's text starts
        self.waiting: collections.deque = collections.deque()  # (TokenLogprob, offset), not yet released

    def prompt(self, prompt_ids: list[int], scored: list[TokenLogprob | None]) -> list[tuple]:
        """An echoed prompt's tokens (the first without a logprob), offsets from 0."""
        entries, at = [], 0
        for token_id, lp in zip(prompt_ids, scored):
            entries.append((token_id, lp, at))
            at += len(token_text(self.tokenizer, token_id))
        return entries

    def push(self, output: RequestOutput) -> list[tuple]:
        """What this output releases."""
        lp = output.logprob
        if lp is not None:
            self.waiting.append((lp, self.next_at))
            if not output.end_of_text:  # end-of-text (generated with ignore_eos) adds no text
                self.next_at += len(token_text(self.tokenizer, lp.token_id))
        self.returned += len(output.text)
        stopped_by_string = output.finish_reason is FinishReason.STOP and not output.end_of_text
        everything = output.finished and not stopped_by_string
        released = []
        while self.waiting and (everything or self.waiting[0][1] < self.returned):
            lp, at = self.waiting.popleft()
            released.append((lp.token_id, lp, at))
        if output.finished:
            self.waiting.clear()  # a stop string's own tokens: their text was never returned
        return released
