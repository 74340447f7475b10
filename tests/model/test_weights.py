"""model/weights.py: one copy of the projection weights (their packed form), and the digest that names them."""


import pytest
import torch

from linserve.model import projection
from linserve.model.checkpoint import load_checkpoint
from linserve.model.loading import DEFAULT_CHECKPOINT
from linserve.model.weights import content_digest, keep_one_copy, state_dict_for_compiler
from tests.helpers import require_kernel

from .families.checkpoints import FAMILY_CASES, write_checkpoint


@pytest.fixture
def kernel():
    require_kernel()


def logits_and_state(model, ids):
    with torch.inference_mode():
        logits, state = model(ids)
    return logits, state


@pytest.mark.parametrize("case", ["shipped", *FAMILY_CASES])
def test_after_the_release_the_model_computes_the_same_bits_from_one_copy(kernel, tmp_path, case):
    path = DEFAULT_CHECKPOINT if case == "shipped" else write_checkpoint(tmp_path / case, FAMILY_CASES[case])
    model = load_checkpoint(path, torch.device("cpu"), torch.bfloat16)
    ids = torch.randint(0, 4000, (3, 11), generator=torch.Generator().manual_seed(0))
    before_logits, before_state = logits_and_state(model, ids)
    digest = content_digest(model).hexdigest()
    weight_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())

    freed = keep_one_copy(model)

    after_logits, after_state = logits_and_state(model, ids)
    assert torch.equal(after_logits, before_logits)
    assert all(torch.equal(a, b) for a, b in zip(after_state.tensors().values(), before_state.tensors().values()))
    released = [p for p in model.parameters() if projection.released(p)]
    assert released and freed == sum(p.numel() * p.element_size() for p in released)
    assert freed > 0.5 * weight_bytes  # most of a model's bytes are its projections
    assert all(p.untyped_storage().nbytes() == 2 and p.dim() == 2 for p in released)  # shape kept, bytes gone
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    assert embeddings and not any(projection.released(e) for e in embeddings)  # (the shipped head is tied: kept)
    assert content_digest(model).hexdigest() == digest  # taken before the release, remembered
    assert keep_one_copy(model) == 0  # once
    for name, tensor in state_dict_for_compiler(model).items():
        original = model.state_dict(keep_vars=True)[name]
        if projection.released(original):
            assert tensor.shape == original.shape and tensor.untyped_storage().nbytes() == 2 and not tensor.any()
        else:
            assert torch.equal(tensor, original.detach())


def test_a_released_weight_is_not_packed_again_in_another_format(kernel, tmp_path):
    model = load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.bfloat16)
    keep_one_copy(model)
    weight = next(p for p in model.parameters() if projection.released(p))
    projection.set_weight_format("int8")
    try:
        with pytest.raises(RuntimeError, match="released after packing"):
            projection.linear(torch.zeros(1, weight.shape[1], dtype=torch.bfloat16), weight)
    finally:
        projection.set_weight_format("bf16")


def test_without_the_kernel_path_nothing_is_released(tmp_path):
    model = load_checkpoint(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.float32)  # fp32: the BLAS reads them
    assert keep_one_copy(model) == 0
    assert not any(projection.released(p) for p in model.parameters())
