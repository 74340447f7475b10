"""model/projection.py: the projections' weight formats (bf16, int8) over linserve's kernel."""


import pytest
import torch

from linserve.model import projection
from tests.helpers import require_kernel


@pytest.fixture
def int8_weights():
    require_kernel()
    projection.set_weight_format("int8")
    yield
    projection.set_weight_format("bf16")


def test_int8_quantization_is_per_output_channel_and_round_trips_within_half_a_step():
    w = torch.randn(48, 200, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, scale = projection.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (48,) and scale.dtype == torch.float32
    assert q.abs().amax(dim=1).eq(127).all()  # each channel's largest weight is ±127
    assert ((q.float() * scale[:, None] - w.float()).abs() <= scale[:, None] / 2 + 1e-7).all()
    zero_q, zero_scale = projection.quantize_int8(torch.zeros(2, 8).bfloat16())  # an all-zero channel: no NaN
    assert zero_q.eq(0).all() and torch.isfinite(zero_scale).all()


@torch.no_grad()
def test_int8_projections_are_the_quantized_weights_through_the_kernel(int8_weights):
    generator = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 96, generator=generator).bfloat16(), torch.randn(40, generator=generator).bfloat16()
    x = torch.randn(9, 96, generator=generator).bfloat16()
    y = projection.linear(x, w, b)
    q, scale = projection.quantize_int8(w)
    assert torch.equal(y, torch.ops.linserve.invariant_linear(x, torch.ops.linserve.pack_weight(q), scale, b, 40))
    assert torch.equal(torch.cat([projection.linear(x[i : i + 1], w, b) for i in range(9)]), y)  # row by row
    bf16 = x.float() @ w.float().T + b.float()
    assert (y.float() - bf16).abs().max() < 0.05 * bf16.abs().max()  # close to the bf16 projection
    projection.set_weight_format("bf16")  # the format changes: the weight is packed again, not reused
    assert not torch.equal(projection.linear(x, w, b), y)


def test_an_unknown_weight_format_is_refused():
    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        projection.set_weight_format("int4")
    assert projection.weight_format() == "bf16"
