"""The decode program's top-k draw as one kernel (model/kernels/sampling.cpp) against its torch form."""

import pytest
import torch

from linserve.model import kernels
from tests.helpers import require_kernel

OP = torch.ops.linserve if kernels.load() else None


@pytest.fixture(autouse=True)
def kernel_built():
    require_kernel()


def test_the_tempered_draw_is_the_torch_programs_token_to_the_bit():
    """kernels/tempered_draw.cpp against sampling's torch form of the program's draw (`_tempered`, then
    `_draw_survivors` — two topk calls, the tie mask, the window — or `_inverse_cdf`): rows with ties at the k-th
    value (logits rounded to quarters), min-p, weights that underflow to 0 (so the k-th weight is 0 and the kernel
    takes every weight), a row of one value, k from 1 to 64 and past the vocabulary, uniforms at 0 and just below 1,
    greedy rows (temperature 0) — every token the same, and each row's the same alone as in the batch; k = 0, no
    filter: `_inverse_cdf` over the whole row."""
    from linserve.server.engine.sampling import TOP_K_IN_PROGRAM, _draw_survivors, _inverse_cdf, _tempered

    generator = torch.Generator().manual_seed(11)
    for vocab in (4096, 300, 40):
        rows = 256
        logits = torch.randn(rows, vocab, generator=generator) * 3  # (B, V)
        logits[::2] = (logits[::2] * 4).round() / 4  # half the rows: ties everywhere
        logits[1::8] *= 400  # large spreads: many weights underflow to exactly 0
        logits[3] = 0.5  # one value: all tie
        temperature = torch.rand(rows, generator=generator) * 1.5 + 0.05
        temperature[5::16] = 0.0  # greedy rows
        greedy, weights = _tempered(logits, temperature)  # (B,), (B, V) float64
        width = min(TOP_K_IN_PROGRAM, vocab)
        k = torch.randint(1, width + 1, (rows,), generator=generator)  # (B,)
        k[:4] = torch.tensor([1, width, width, 2])
        min_p = torch.rand(rows, generator=generator) * torch.tensor([0.0, 0.0, 0.1, 0.5]).repeat(rows // 4)
        uniforms = torch.rand(rows, generator=generator)
        uniforms[:3] = torch.tensor([0.0, 1.0 - 2**-24, 0.5])
        sampled = temperature > 0
        drawn = OP.tempered_draw(logits, temperature, k, min_p, uniforms)  # (B,)
        expected = torch.where(sampled, _draw_survivors(weights, k, min_p, uniforms, width), greedy)
        assert drawn.equal(expected), (vocab, (drawn != expected).nonzero()[:5].flatten().tolist())
        alone = torch.stack([OP.tempered_draw(logits[b : b + 1], temperature[b : b + 1], k[b : b + 1],
                                              min_p[b : b + 1], uniforms[b : b + 1])[0] for b in range(0, rows, 17)])
        assert alone.equal(drawn[::17])
        assert len(set(drawn.tolist())) > rows // 8  # (not one token for every row)
        whole = OP.tempered_draw(logits, temperature, torch.zeros_like(k), min_p, uniforms)  # min-p not applied
        assert whole.equal(torch.where(sampled, _inverse_cdf(weights, uniforms), greedy)), vocab


def test_the_tempered_draw_refuses_what_it_cannot_compute_with_a_message():
    one, ones = torch.ones(2), torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="fp32"):
        OP.tempered_draw(torch.zeros(2, 8).double(), one, ones, one, one)
    with pytest.raises(RuntimeError, match="one temperature, k, min_p, uniform a row"):
        OP.tempered_draw(torch.zeros(2, 8), one, torch.ones(3, dtype=torch.long), one, one)
