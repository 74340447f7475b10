"""Batch-invariant numerics (model/numerics.py): at bf16 inference on a CPU a token's logits and state are the
same bits whatever else is computed beside it — rows in the batch, how the sequence was split, the form (one
recurrent step, the scan over a chunk, the state after every prefix) — eager and compiled."""

from __future__ import annotations

import pytest
import torch

from linserve.model import LinearGPT, numerics
from linserve.model.loading import DEFAULT_CHECKPOINT, in_dtype
from tests.model.test_gpt import VARIANTS, tiny

LINEAR = [name for name in VARIANTS if not name.startswith("softmax")]


@pytest.fixture(autouse=True)
def cpu_only(device):
    if device.type != "cpu":
        pytest.skip("bit-exact numerics are the CPU's bf16 path (oneDNN); CUDA keeps cuBLAS's kernels")


def exact_model(name: str, device) -> LinearGPT:
    torch.manual_seed(0)
    return in_dtype(LinearGPT(tiny(**VARIANTS[name])).eval().to(device), torch.bfloat16)


def same_state(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values(), strict=True))


def test_tree_sum_adds_in_its_fixed_pairwise_order():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0], dtype=torch.float32)
    # levels: [1e8 + -1e8, 1 + 1] + [3] → [0, 2, 3] → [0 + 2] + [3] → [2, 3] → 5
    assert numerics.tree_sum(x, 0).item() == 5.0
    rows = torch.randn(6, 37, generator=torch.Generator().manual_seed(1))
    assert torch.equal(numerics.tree_sum(rows, -1)[2:3], numerics.tree_sum(rows[2:3], -1))


def test_lookup_tables_are_the_float64_function_rounded_once():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        gelu = numerics.gelu(x)
    assert gelu.dtype == torch.bfloat16
    assert torch.equal(gelu, numerics._gelu_tanh64(x.double()).to(torch.bfloat16))
    from linserve.model.feature_maps import elu1

    assert torch.equal(numerics.lookup(numerics.bf16_table("elu1", elu1, torch.float32, x.device), x),
                       elu1(x.double()).float())


def test_a_bf16_lookup_reads_the_entry_of_its_own_bit_pattern_eager_and_compiled():
    """The int16 index (a bf16 tensor) and the fp32 one (its exact widening) pick the same entry for every one of the
    65,536 patterns — negative values, infinities and NaNs included — and so does the compiled form."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # (65536,) every bf16 pattern
    x = patterns.view(torch.bfloat16)  # (65536,)
    table = torch.arange(65536, dtype=torch.int32)  # (65536,) entry i holds its own index: the unsigned pattern i
    expected = patterns.to(torch.int32) & 0xFFFF  # (65536,) unsigned
    assert torch.equal(numerics.lookup(table, x), expected)
    assert torch.equal(numerics.lookup(table, x.float()), expected)
    assert torch.equal(torch.compile(numerics.lookup)(table, x), expected)


@pytest.mark.parametrize("shape", [(256, 768), (256, 256), (256, 1024), (1024, 256), (256, 4096), (64, 192)])
def test_every_projection_of_the_shipped_shapes_gives_a_row_the_same_bits_in_any_batch(shape, device):
    """The kernel property the whole construction rests on, checked on this machine's BLAS: a row of
    `numerics.linear` is the same for every M (a BLAS that changed its kernels would fail here first)."""
    K, N = shape
    generator = torch.Generator().manual_seed(K + N)
    weight = torch.randn(N, K, generator=generator).to(device, torch.bfloat16)
    x = torch.randn(300, K, generator=generator).to(device, torch.bfloat16)
    alone = torch.cat([numerics.linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    for M in [*range(1, 70), 128, 255, 256, 300]:
        for start in (0, x.shape[0] - M):
            assert torch.equal(numerics.linear(x[start : start + M], weight), alone[start : start + M]), (M, start)


@pytest.mark.parametrize("name", LINEAR)
@torch.no_grad()
def test_a_token_is_the_same_bits_whatever_the_split_the_form_or_the_batch(name, device):
    """Invariant 1 and 3, exactly: one forward over the whole text == any split of it == token by token ==
    the state after every prefix == the same row inside a batch of others."""
    model = exact_model(name, device)
    ids = torch.randint(1, 97, (5, 40), generator=torch.Generator().manual_seed(3)).to(device)
    logits, state = model(ids)
    for split in (1, 7, 16, 33, 39):
        _, head = model(ids[:, :split])
        tail_logits, tail = model(ids[:, split:], head)
        assert torch.equal(tail_logits, logits[:, split:]) and same_state(tail, state), split
    step_state = model(ids[:, :30])[1]
    _, prefixes = model(ids[:, 30:], step_state, prefixes=True)
    for t in range(30, 40):
        step_logits, step_state = model(ids[:, t : t + 1], step_state)
        assert torch.equal(step_logits[:, 0], logits[:, t]), t
        picked = prefixes.select_prefix(torch.full((5,), t - 30, device=device))
        assert same_state(picked, step_state), t
    assert same_state(step_state, state)
    alone_logits, alone = model(ids[3:4])
    assert torch.equal(alone_logits[0], logits[3])
    assert all(torch.equal(a[0], b[3]) for a, b in zip(alone.tensors().values(), state.tensors().values()))


def test_training_keeps_the_parallel_form_and_torchs_kernels():
    """With autograd on, the chunked form and torch's fused kernels: the same function to bf16 rounding."""
    model = in_dtype(LinearGPT(tiny(**VARIANTS["elu1-decay"])), torch.bfloat16).train()
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    trained, _ = model(ids)
    trained.sum().backward()
    assert model.wte.weight.grad is not None
    with torch.no_grad():
        exact, _ = model(ids)
    torch.testing.assert_close(exact.float(), trained.detach().float(), rtol=0.05, atol=0.05)  # one function


@pytest.mark.slow
@torch.no_grad()
def test_the_compiled_decode_step_is_the_eager_one_bit_for_bit(device):
    """The shipped model in bf16, its decode program compiled by Inductor under `same_bits_as_eager` (the
    settings the AOTInductor builds use) in two batch sizes: logits, draws and the states each writes into its
    pool equal eager's exactly."""
    import torch._inductor.config as inductor_config

    from linserve.model.loading import load_model
    from linserve.server.engine.compile.program_compiler import same_bits_as_eager
    from linserve.server.engine.decode_program import decode_program
    from linserve.server.engine.sampling import SlotSampling
    from linserve.server.engine.state_pool import StatePool

    model = in_dtype(load_model(DEFAULT_CHECKPOINT, device).model, torch.bfloat16)
    numerics.prepare_tables(device)
    pool, sampling = StatePool(model, 8, device), SlotSampling(8, model.config.vocab_size, device)
    _, history = model(torch.randint(1, 4000, (8, 50), generator=torch.Generator().manual_seed(5)))
    for name, tensor in zip(pool.buffers, history.tensors().values()):
        pool.buffers[name].copy_(tensor)
    sampling.floats[0, 4:] = 0.8  # half the slots sample (seeded), half are greedy
    sampling.seed.copy_(torch.arange(8) * 7919)
    sampling.top_k[4:7] = torch.tensor([50, 3, 64])  # top-k drawn in the program (with min-p on one)
    sampling.floats[2, 6] = 0.05
    program = decode_program(model)
    settings = same_bits_as_eager(model)
    with inductor_config.patch({key: value for key, value in settings.items() if key != "freezing"}):
        compiled = torch.compile(program, fullgraph=True, dynamic=False)
        for slots in ([5], [0, 3, 4, 7]):
            index = torch.tensor(slots)
            rows = (torch.tensor([11 * s + 3 for s in slots]), index, torch.full((len(slots),), 50))
            # each program writes its rows' new state and penalty counts into its own copies of the pool and the
            # sampling tensors: the copies must agree too
            ours, theirs = ([t.clone() for t in (*pool.buffers.values(), *sampling.tensors())] for _ in range(2))
            for n, (got, want) in enumerate(zip(compiled(*rows, *ours), program(*rows, *theirs), strict=True)):
                assert torch.equal(got, want), (slots, n)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), slots
            for got, want, before in zip(ours, theirs, pool.buffers.values()):  # (the state buffers come first)
                assert torch.equal(got, want), slots
                assert not torch.equal(got[index], before[index]) or not before[index].any(), slots  # written


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("family", ["linear_attn", "gla", "gated_deltanet", "mamba2", "rwkv7"])
def test_an_fla_decode_step_compiled_with_frozen_weights_is_the_eager_one_bit_for_bit(family, tmp_path):
    """fla's block layout adds each projection's output to the residual stream; compiled with the weights
    frozen (as the AOTInductor builds are), Inductor fused that add into oneDNN's projection call — one rounding
    where eager makes two — and the logits differed from eager's by a bf16 ulp. Under `same_bits_as_eager` the
    step's logits and states are eager's exactly."""
    import torch._inductor.config as inductor_config

    from linserve.model.checkpoint import load_checkpoint
    from linserve.model.decode_step import flat_decode_step
    from linserve.server.engine.compile.program_compiler import same_bits_as_eager
    from tests.model.families.checkpoints import FAMILY_CASES, write_checkpoint

    directory = write_checkpoint(tmp_path, FAMILY_CASES[family])
    model = in_dtype(load_checkpoint(directory, torch.device("cpu")), torch.bfloat16).eval()
    numerics.prepare_tables("cpu")
    state = model.init_state(2, "cpu").tensors()
    generator = torch.Generator().manual_seed(3)
    state = [t.normal_(generator=generator) if t.is_floating_point() else t for t in state.values()]
    tokens = torch.tensor([[17], [902]])
    step = flat_decode_step(model)
    torch._dynamo.reset()  # (frozen weights are compiled in: nothing from another test's model may be reused)
    with inductor_config.patch(same_bits_as_eager(model)):
        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        for got, want in zip(compiled(tokens, *state), step(tokens, *state), strict=True):
            assert torch.equal(got, want)
