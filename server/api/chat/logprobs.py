"""Chat's logprobs format: each returned token with its bytes and its top alternatives."""

from __future__ import annotations

from ...engine.types import RequestOutput
from ..common.choice_logprobs import ChoiceLogprobs, token_text
from ..common.protocol import ChatTokenLogprob, TopLogprob


def chat_entries(tokenizer, entries: list[tuple]) -> list[ChatTokenLogprob]:
    """Entries in the chat format (each token with its bytes and its top alternatives)."""
    content = []
    for token_id, lp, _ in entries:
        text = token_text(tokenizer, token_id)
        top = [TopLogprob(token=token_text(tokenizer, t), logprob=v, bytes=list(token_text(tokenizer, t).encode()))
               for t, v in lp.top]
        content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
    return content


def chat_logprobs(tokenizer, outputs: list[RequestOutput]) -> list[ChatTokenLogprob]:
    """A whole chat choice's logprobs: the tokens of its returned content (a stop string's own are not)."""
    choice = ChoiceLogprobs(tokenizer)
    return [entry for output in outputs for entry in chat_entries(tokenizer, choice.push(output))]
