"""The exact path's own forms of the newer families' normalisations compute the same function as torch's (fed
fp32 here, so only the summation order differs): RWKV-7's per-head GroupNorm and Mamba2's gated group RMSNorm.
The bf16 invariance tests cannot see a wrong formula on the exact path — only a batch-dependent one."""

from __future__ import annotations

import pytest
import torch

from linserve.model import families
from tests.model.families.checkpoints import BASE, FAMILY_CASES


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    built = {name: families.build({**BASE, **FAMILY_CASES[name]}) for name in ("rwkv7", "mamba2")}
    with torch.no_grad():
        for model in built.values():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return built


def test_rwkv7s_exact_group_norm_is_the_group_norm(models):
    mix = models["rwkv7"].body.layers[1].attn
    heads = mix.config.num_heads
    o = torch.randn(2, 5, heads, mix.value_dim // heads) * 3 + 1  # (B, T, H, dv)
    with torch.no_grad():
        torch.testing.assert_close(mix.group_norm(o, exact=True), mix.group_norm(o, exact=False), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("before_gate", [False, True])
def test_mamba2s_exact_gated_norm_is_the_gated_norm(models, before_gate):
    from linserve.model.families.mamba2 import gated_rms_norm

    mixer = models["mamba2"].body.layers[0].mixer
    config = mixer.config
    config.norm_before_gate = before_gate
    y, gate = torch.randn(2, 5, config.intermediate_size) * 2, torch.randn(2, 5, config.intermediate_size)
    exact_gate = gate.bfloat16()  # the exact path's gate is bf16 (a lookup table), the same values here
    with torch.no_grad():  # (inference: the exact path's SiLU is the table's)
        exact = gated_rms_norm(y, exact_gate, mixer.norm.weight, config, exact=True)
        plain = gated_rms_norm(y, exact_gate.float(), mixer.norm.weight, config, exact=False)
    torch.testing.assert_close(exact, plain, atol=1e-5, rtol=1e-5)
