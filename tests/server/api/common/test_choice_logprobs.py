"""The logprobs a choice returns, from real engine outputs' shape and the real tokenizer: offsets
are positions in the returned text, released with it."""

from __future__ import annotations

from linserve.server.api.common.choice_logprobs import ChoiceLogprobs
from linserve.server.api.common.completion_serving import add_completion_entries
from linserve.server.api.common.protocol import CompletionLogprobs
from linserve.server.engine.types import FinishReason, RequestOutput, TokenLogprob


def outputs(tokenizer, ids: list[int], texts: list[str], reason: FinishReason) -> list[RequestOutput]:
    """As the engine makes them: an end-of-text token says so (`end_of_text`)."""
    return [RequestOutput(request_id="r", index=0, token_id=i, text=t,
                          logprob=TokenLogprob(token_id=i, logprob=-1.0, top=()),
                          finish_reason=reason if n == len(ids) - 1 else None,
                          end_of_text=i == tokenizer.eos_token_id)
            for n, (i, t) in enumerate(zip(ids, texts))]


def test_end_of_text_generated_with_ignore_eos_adds_no_text(hf_tokenizer):
    """Issue 31 row 12: the detokenizer returns no text for end-of-text, so the tokens after it start where the
    text before it ended (they were shifted by the length of its name, 13)."""
    eos = hf_tokenizer.eos_token_id
    words = hf_tokenizer.encode(" the king")
    ids = [words[0], eos, *words[1:]]
    texts = [hf_tokenizer.decode([words[0]]), "", *(hf_tokenizer.decode([w]) for w in words[1:])]
    result, choice = CompletionLogprobs(), ChoiceLogprobs(hf_tokenizer)
    for output in outputs(hf_tokenizer, ids, texts, FinishReason.LENGTH):
        add_completion_entries(hf_tokenizer, result, choice.push(output))
    text = "".join(texts)
    assert result.tokens[1] == "<|endoftext|>" and result.text_offset[1] == result.text_offset[2] == len(texts[0])
    for token, at in zip(result.tokens, result.text_offset):
        assert token == "<|endoftext|>" or text[at:at + len(token)] == token


def test_a_rows_tokens_wait_for_their_text(hf_tokenizer):
    """A token whose text the stop matcher still withholds is released with that text, never before."""
    ids = hf_tokenizer.encode(" the king of")
    pieces = [hf_tokenizer.decode([i]) for i in ids]
    texts = ["", pieces[0] + pieces[1], "", "".join(pieces[2:])]  # withheld, released, withheld, flushed
    released = []
    choice = ChoiceLogprobs(hf_tokenizer)
    for output in outputs(hf_tokenizer, ids, texts, FinishReason.LENGTH):
        result = CompletionLogprobs()
        add_completion_entries(hf_tokenizer, result, choice.push(output))
        released.append(result.tokens)
    assert released == [[], pieces[:2], [], pieces[2:]]
