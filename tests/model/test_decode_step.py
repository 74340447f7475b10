"""The flat decode step (what gets compiled) is the model's own recurrent step, repackaged."""

import pytest
import torch

from linserve.model import LinearGPT, ModelConfig, ModelState
from linserve.model.decode_step import flat_decode_step, state_names


@pytest.mark.parametrize("conv_kernel", [0, 3])
def test_flat_step_is_the_forward_step(conv_kernel, device):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, conv_kernel=conv_kernel, decay=True)
    model = LinearGPT(config).eval().to(device)
    _, state = model(torch.randint(0, 512, (3, 9), device=device))  # a non-trivial starting state
    tokens = torch.randint(0, 512, (3, 1), device=device)
    names = state_names(model)
    assert names == list(state.tensors())  # the flat order is ModelState's
    with torch.inference_mode():
        want_logits, want_state = model(tokens, state)
        got = flat_decode_step(model)(tokens, *[state.tensors()[n] for n in names])
    assert torch.equal(got[0], want_logits[:, 0].float())
    for name, tensor in zip(names, got[1:]):
        assert torch.equal(tensor, want_state.tensors()[name]), name
        assert tensor.dtype == torch.float32
    rebuilt = ModelState.from_tensors(dict(zip(names, got[1:])), config.n_layers, "linear")
    assert rebuilt.nbytes() == model.state_bytes(0) * 3


def test_softmax_models_have_no_flat_step():
    model = LinearGPT(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, attention="softmax"))
    with pytest.raises(ValueError, match="linear"):
        flat_decode_step(model)
