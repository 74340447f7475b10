import math

import torch

from linserve.model import LinearGPT, ModelConfig
from linserve.model.training.evaluate import bits_per_byte


def test_bits_per_byte_independent_of_block_size(corpus, small_tokenizer):
    torch.manual_seed(0)
    model = LinearGPT(
        ModelConfig(vocab_size=1024, d_model=32, n_layers=2, n_heads=4, decay=True, conv_kernel=3, chunk_size=16)
    )
    works = {"lucrece": corpus.train["rape_of_lucrece"][:20_000]}
    a = bits_per_byte(model, small_tokenizer, works, block=64)
    b = bits_per_byte(model, small_tokenizer, works, block=1000)
    assert abs(a.bits_per_byte - b.bits_per_byte) < 1e-5
    assert a.bytes == len(works["lucrece"].encode())
    # an untrained model is near uniform: ln(V) nats per token
    assert abs(a.nats_per_token - math.log(1024)) < 0.5
    assert a.bits_per_byte == a.nats_per_token * a.tokens / math.log(2) / a.bytes


def test_windowed_scoring_forgets_between_windows(corpus, small_tokenizer):
    torch.manual_seed(0)
    model = LinearGPT(ModelConfig(vocab_size=1024, d_model=32, n_layers=1, n_heads=4, chunk_size=16))
    works = {"lucrece": corpus.train["rape_of_lucrece"][:5_000]}
    carried = bits_per_byte(model, small_tokenizer, works)
    windowed = bits_per_byte(model, small_tokenizer, works, window=32)
    assert carried.tokens == windowed.tokens
    assert carried.bits_per_byte != windowed.bits_per_byte


def test_batched_windows_equal_one_window_at_a_time(corpus, small_tokenizer):
    from linserve.model.training.evaluate import work_nll

    torch.manual_seed(0)
    model = LinearGPT(
        ModelConfig(vocab_size=1024, d_model=32, n_layers=1, n_heads=4, chunk_size=16, attention="softmax")
    )
    ids = torch.tensor(small_tokenizer.encode(corpus.train["sonnets"][:3_000]).ids)
    batched = work_nll(model, ids, block=0, window=40, batch=7)
    single = work_nll(model, ids, block=0, window=40, batch=1)
    assert abs(batched - single) < 1e-3 * abs(single)
