"""Model-level invariants: full forward == prefill-then-decode, constant state size, long-context bf16."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from linserve.model import LinearGPT, ModelConfig, ModelState
from tests.devices import device_under_test

DEVICE = device_under_test()  # `pytest --device cuda` runs these on the GPU

VARIANTS = {
    "elu1": dict(),
    "relu": dict(feature_map="relu"),
    "favor": dict(feature_map="favor", favor_features=24),
    "elu1-decay": dict(decay=True),
    "elu1-conv": dict(conv_kernel=4),
    "favor-decay-conv": dict(feature_map="favor", favor_features=16, decay=True, conv_kernel=2),
    "softmax": dict(attention="softmax"),
    "softmax-alibi-conv": dict(attention="softmax", decay=True, conv_kernel=3),
}


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, chunk_size=8)
    return ModelConfig(**{**base, **overrides})


def build(config: ModelConfig, seed: int = 0) -> LinearGPT:
    torch.manual_seed(seed)
    return LinearGPT(config).eval().to(DEVICE)


def states_close(a: ModelState, b: ModelState, rtol: float) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(torch.allclose(ta[n], tb[n], rtol=rtol, atol=rtol) for n in ta)


@pytest.mark.parametrize("name", VARIANTS)
@torch.no_grad()
def test_full_forward_equals_prefill_then_decode(name):
    model = build(tiny(**VARIANTS[name]))
    ids = torch.randint(0, 97, (3, 37), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    full_logits, full_state = model(ids)
    worst = 0.0
    for split in (1, 7, 8, 20, 36):
        logits, state = model(ids[:, :split])
        pieces = [logits]
        for t in range(split, ids.shape[1]):
            logits, state = model(ids[:, t : t + 1], state)
            pieces.append(logits)
        decoded = torch.cat(pieces, dim=1)
        worst = max(worst, ((decoded - full_logits).abs().max() / full_logits.abs().max()).item())
        assert states_close(state, full_state, rtol=1e-5)
    assert worst < 1e-5, worst


@pytest.mark.parametrize("name", ["elu1", "favor-decay-conv"])
@torch.no_grad()
def test_random_prefill_splits_carry_state_exactly(name):
    model = build(tiny(**VARIANTS[name]))
    ids = torch.randint(0, 97, (2, 61), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    full_logits, full_state = model(ids)
    rng = torch.Generator().manual_seed(3)
    for _ in range(4):
        cuts = sorted(set(torch.randint(1, 61, (4,), generator=rng).tolist()))
        state, pieces = None, []
        for a, b in zip([0, *cuts], [*cuts, 61]):
            logits, state = model(ids[:, a:b], state)
            pieces.append(logits)
        assert torch.allclose(torch.cat(pieces, 1), full_logits, rtol=1e-5, atol=1e-5)
        assert states_close(state, full_state, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in VARIANTS if not n.startswith("softmax")])
@torch.no_grad()
def test_state_bytes_is_the_formula_and_constant_in_length(name):
    config = tiny(**VARIANTS[name])
    model = build(config)
    sizes = set()
    for length in (1, 9, 100):
        _, state = model(torch.randint(0, 97, (1, length), device=DEVICE))
        assert state.nbytes() == model.state_bytes() == config.state_bytes()
        sizes.add(state.nbytes())
        assert all(t.dtype == torch.float32 for t in state.tensors().values())
    assert len(sizes) == 1
    H, dk, dv, L = config.n_heads, config.d_feature, config.d_head, config.n_layers
    assert config.state_bytes() == L * 4 * (H * dk * dv + H * dk + config.conv_window * config.d_model)


@torch.no_grad()
def test_softmax_kv_cache_grows_with_context():
    config = tiny(attention="softmax")
    model = build(config)
    for length in (1, 9, 100):
        _, state = model(torch.randint(0, 97, (1, length), device=DEVICE))
        assert state.nbytes() == config.state_bytes(length)


@torch.no_grad()
def test_state_stays_fp32_with_bf16_weights():
    model = build(tiny(decay=True, conv_kernel=3)).to(torch.bfloat16)
    logits, state = model(torch.randint(0, 97, (2, 20), device=DEVICE))
    logits, state = model(torch.randint(0, 97, (2, 1), device=DEVICE), state)
    assert logits.dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 and t.device.type == DEVICE.type for t in state.tensors().values())


@pytest.mark.parametrize("feature_map", ["elu1", "favor"])
@torch.no_grad()
def test_32k_tokens_under_bf16_autocast(feature_map):
    model = build(tiny(feature_map=feature_map, favor_features=16, decay=False, chunk_size=64, d_model=64))
    ids = torch.randint(0, 97, (1, 32_768), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logits, state = model(ids)
        next_logits, state = model(ids[:, -1:], state)
    assert torch.isfinite(logits).all() and torch.isfinite(next_logits).all()
    for tensor in state.tensors().values():
        assert tensor.dtype == torch.float32 and torch.isfinite(tensor).all()


@torch.no_grad()
def test_left_padding_mask_leaves_state_as_if_absent():
    model = build(tiny(decay=True, conv_kernel=3))
    ids = torch.randint(1, 97, (1, 12), device=DEVICE)
    logits, state = model(ids)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long, device=DEVICE), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 12)], dim=1).to(DEVICE)
    padded_logits, padded_state = model(padded, key_mask=mask)
    assert torch.allclose(padded_logits[:, 5:], logits, atol=1e-5)
    assert states_close(padded_state, state, rtol=1e-5)


def test_state_round_trips_through_its_flat_tensors():
    model = build(tiny(conv_kernel=2))
    _, state = model(torch.randint(0, 97, (3, 10), device=DEVICE))
    restored = ModelState.from_tensors(state.tensors(), n_layers=2, attention="linear")
    assert states_close(restored, state, rtol=0)


def test_config_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="feature_map"):
        ModelConfig(feature_map="cosine")
    with pytest.raises(ValueError, match="attention"):
        ModelConfig(attention="mamba")
    with pytest.raises(ValueError, match="conv_kernel"):
        ModelConfig(conv_kernel=1)


def test_model_package_does_not_import_serving_code():
    """Invariant 7: every module of linserve.model imports, and none brings in the server or its libraries."""
    code = (
        "import sys, importlib, pkgutil, linserve.model as m; "
        "[importlib.import_module(p.name) for p in pkgutil.walk_packages(m.__path__, 'linserve.model.')]; "
        "bad = [n for n in ('linserve.server', 'fastapi', 'pydantic', 'prometheus_client', 'uvicorn') "
        "if n in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("decay", [False, True])
@torch.no_grad()
def test_softmax_left_padded_batch_equals_rows_alone(decay):
    model = build(tiny(attention="softmax", decay=decay))
    short, long = torch.randint(0, 97, (1, 5), device=DEVICE), torch.randint(0, 97, (1, 12), device=DEVICE)
    _, s_short = model(short)
    _, s_long = model(long)
    pad = 12 - 5
    layers = []
    for a, b in zip(s_short.blocks, s_long.blocks):
        k = torch.cat([torch.cat([a.attn.k.new_zeros(1, 4, pad, 8), a.attn.k], 2), b.attn.k])
        v = torch.cat([torch.cat([a.attn.v.new_zeros(1, 4, pad, 8), a.attn.v], 2), b.attn.v])
        valid = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)], 1),
                           torch.ones(1, 12, dtype=torch.bool)]).to(DEVICE)
        layers.append(type(a)(attn=type(a.attn)(k=k, v=v, valid=valid), conv=None))
    batch_state = ModelState(blocks=tuple(layers))
    step = torch.tensor([[3], [4]], device=DEVICE)
    batched, _ = model(step, batch_state)
    alone_short, _ = model(step[:1], s_short)
    alone_long, _ = model(step[1:], s_long)
    assert torch.allclose(batched[0], alone_short[0], atol=1e-5)
    assert torch.allclose(batched[1], alone_long[0], atol=1e-5)


def test_short_conv_is_a_causal_depthwise_convolution():
    import torch.nn.functional as F

    from linserve.model.families.linear_gpt import ShortConv

    conv = ShortConv(tiny(conv_kernel=4))
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(2, 9, 32)
    y, window = conv(x, None)
    padded = torch.cat([torch.zeros(2, 3, 32), x], 1)
    expected = F.conv1d(padded.transpose(1, 2), conv.weight[:, None, :], groups=32).transpose(1, 2)
    assert torch.allclose(y, expected, atol=1e-6)
    assert torch.equal(window, x[:, -3:])
