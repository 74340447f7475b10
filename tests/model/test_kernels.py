"""linserve's projection kernel (model/kernels): the function it computes, batch invariance in every form, int8. (Which
form is built and how: test_kernel_forms.py; the decode program's draw: test_draw_kernel.py; the recurrence kernels:
test_recurrence_kernels.py.)"""

import threading
from contextlib import contextmanager

import pytest
import torch

from linserve.model import kernels, numerics, projection
from tests.helpers import require_kernel

OP = torch.ops.linserve if kernels.load() else None


@pytest.fixture(autouse=True)
def kernel_built():
    require_kernel()


SHAPES = [(1, 768, 256), (3, 50, 77), (7, 1024, 1024), (33, 33, 300), (130, 256, 1024), (40, 40, 64), (5, 17, 31),
          (9, 40, 1100)]  # (K > 1024: packed bf16 weights six rows a pass, not two; the AVX2 lanes: three blocks of k)


def operands(M, N, K, seed=0, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed + M * 131 + N * 7 + K)
    x = torch.randn(M, K, generator=generator).bfloat16()  # (M, K)
    w = torch.randn(N, K, generator=generator)  # (N, K)
    b = torch.randn(N, generator=generator).bfloat16()  # (N,)
    return x, (w.bfloat16() if dtype == torch.bfloat16 else w.mul(20).round().clamp(-127, 127).to(torch.int8)), b


def lanes_reference(x, w, scale=None, bias=None):
    """The lanes form's definition in float64-free torch: per output, 16 lanes each accumulating its pairs of
    every 32-wide chunk (odd then even product, fp32 roundings), then the tree of halves, then bias, then bf16."""
    M, K = x.shape
    pad = (-K) % 32
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(M, 1, -1, 16, 2)  # (M, 1, chunks, 16, 2)
    wf = torch.nn.functional.pad(w.float(), (0, pad)).view(1, w.shape[0], -1, 16, 2)  # (1, N, chunks, 16, 2)
    lanes = torch.zeros(M, w.shape[0], 16)  # (M, N, 16)
    for c in range(xf.shape[2]):
        lanes = lanes + xf[:, :, c, :, 1] * wf[:, :, c, :, 1]
        lanes = lanes + xf[:, :, c, :, 0] * wf[:, :, c, :, 0]
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half : 2 * half]
    out = lanes[..., 0]  # (M, N)
    if scale is not None:
        out = out * scale
    if bias is not None:
        out = out + bias.float()
    return out.bfloat16()


@pytest.mark.parametrize("M,N,K", SHAPES)
def test_the_lanes_form_computes_its_definition_in_avx512_and_in_scalar_code(M, N, K):
    x, w, b = operands(M, N, K)
    want = lanes_reference(x, w, bias=b)
    assert torch.equal(OP.invariant_linear_scalar(x, w, None, b, N), want)
    assert torch.equal(OP.invariant_linear(x, w, None, b, N), want)  # (N, K) weights: the lanes form
    if kernels.form() in kernels.LANES_FORMS:  # the lanes over weights packed in groups of 16 outputs: the same bits
        packed = OP.pack_weight(w)
        assert packed.shape == ((N + 15) // 16, (K + 31) // 32, 16, 32)
        assert torch.equal(OP.invariant_linear(x, packed, None, b, N), want)
        q = w.float().mul(20).round().clamp(-127, 127).to(torch.int8)  # int8 packed alike
        scale = torch.rand(N, generator=torch.Generator().manual_seed(2)) / 20
        assert torch.equal(OP.invariant_linear(x, OP.pack_weight(q), scale, b, N),
                           lanes_reference(x, q.float().bfloat16(), scale, b))


def test_every_int8_value_is_widened_to_its_own_bf16():
    """Each of the 256 int8 values (-128 and 0 among them) once in each of 32 rows, at 32 positions, packed and
    (N, K), read out one by one: x a one-hot row per k and scale 1 make each output the widened weight itself,
    exactly — however this CPU's form widens (through fp32, or through AVX512-FP16 where `fp16_widening` holds: a
    rebias that must keep 0 at 0 and each sign); every row of the batch and each alone (the one-row passes), and a
    random x against the definition."""
    N, K = 32, 256
    values = torch.arange(-128, 128, dtype=torch.int16)  # (256,)
    generator = torch.Generator().manual_seed(5)
    q = torch.stack([values[torch.randperm(K, generator=generator)] for _ in range(N)]).to(torch.int8)  # (N, K)
    ones = torch.ones(N)  # (N,)
    weights = [q, OP.pack_weight(q)] if kernels.form() in kernels.LANES_FORMS else [q]
    for weight in weights:
        assert torch.equal(OP.invariant_linear(torch.eye(K).bfloat16(), weight, ones, None, N), q.T.bfloat16())
        for k in (0, 1, 31, 32, 100, 255):  # (K, N): row k is weight column k
            one_hot = torch.zeros(1, K).bfloat16()
            one_hot[0, k] = 1
            assert torch.equal(OP.invariant_linear(one_hot, weight, ones, None, N), q[:, k : k + 1].T.bfloat16())
        x = torch.randn(3, K, generator=generator).bfloat16()  # (3, K)
        scale = torch.rand(N, generator=generator) / 20  # (N,)
        want = lanes_reference(x, q.float().bfloat16(), scale)
        assert torch.equal(OP.invariant_linear(x, weight, scale, None, N), want)


def test_the_vector_lanes_round_edge_values_as_the_scalar_code_does():
    """Subnormal inputs (read as zero), products and sums below fp32's normal range (flushed), infinities, NaN, sums
    that overflow and outputs halfway between two bf16 values: the vector lanes (VDPBF16PS, or its arithmetic in
    plain AVX512) give the scalar code's bits — outputs compared as bit patterns, so NaN equals NaN."""
    if kernels.form() not in kernels.LANES_FORMS:
        pytest.skip(f"no vector lanes form on this CPU ({kernels.form()})")
    generator = torch.Generator().manual_seed(5)
    M, N, K = 4, 48, 96
    x = torch.randn(M, K, generator=generator).bfloat16()  # (M, K)
    w = torch.randn(N, K, generator=generator).bfloat16()  # (N, K)
    tiny = torch.tensor([1e-39, -3e-40, 2e-20, 1e-30], dtype=torch.float32).bfloat16()  # subnormals; tiny products
    x[0, :4], w[:4, :4] = tiny, tiny.repeat(4, 1)
    x[1, 5], w[7, 5] = float("inf"), float("nan")
    x[2, :K] = 3e38  # sums past fp32's range
    w[9:11] = 0.0
    w[9, 0] = w[10, 1] = 1.0
    x[3, 0], x[3, 1] = 1.0, 1.0 + 2 ** -7  # + 2⁻⁸: halfway between two bf16 values, to even (down, then up)
    bias = torch.randn(N, generator=generator).bfloat16()
    bias[9] = bias[10] = 2 ** -8
    want = OP.invariant_linear_scalar(x, w, None, bias, N)
    got = OP.invariant_linear(x, OP.pack_weight(w), None, bias, N)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(OP.invariant_linear(x, w, None, bias, N).view(torch.int16), want.view(torch.int16))


@contextmanager
def switched(set_switch, on: bool):
    """A kernel switch set for the block and put back after it; set_switch(on) answers what it was:
    `kernels.set_fused_rows` (the AVX512-BF16 form's fused rows; elsewhere nothing changes), `kernels.set_streamed_rows`
    (rows a streamed call takes after a first row alone) or `OP.use_work_pool`
    (this thread's kernel regions on linserve's pool, work_pool.h, or OpenMP's, as the engine thread switches)."""
    was = set_switch(on)
    try:
        yield
    finally:
        set_switch(was)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("M,N,K", [(4, 48, 1024), (9, 40, 1100), (70, 33, 300), (6, 16, 31), (13, 768, 256),
                                   (5, 32, 2816)])
def test_rows_fused_or_through_vdpbf16ps_compute_the_definition(M, N, K, fused):
    """The AVX512-BF16 form runs calls of four rows or more over packed bf16 weights as fused multiply-adds where
    this CPU issues those faster than VDPBF16PS (`kernels.fused_rows`, timed at load): four rows at a time, the rest
    through VDPBF16PS. Either way every output is the lanes' definition to the bit (rows 4-69 of one block, K a
    multiple of 32 or not; the other forms run their own steps whatever the switch says)."""
    x, w, b = operands(M, N, K)
    with switched(kernels.set_fused_rows, fused):
        got = OP.invariant_linear(x, OP.pack_weight(w), None, b, N)
    assert torch.equal(got.view(torch.int16), lanes_reference(x, w, bias=b).view(torch.int16))


@pytest.mark.parametrize("M", [1, 2, 4, 6])
def test_the_fused_step_is_taken_only_where_it_gives_the_unfused_steps_bits(M):
    """The plain-AVX512 and AVX2 lanes fuse each multiply and add on calls over packed weights (one row or several),
    which gives the same bits only while every product is exact and normal: one below fp32's normal range is flushed
    by the multiply and kept by a fused multiply-add. An x or a packed weight with a nonzero value out of [2^-63,
    2^64) keeps the call unfused, so these outputs are the scalar code's (with the checks removed, both differ: lane 0
    sums 2^-126 and 63 products of 2^-133 that the unfused step flushes). The AVX512-BF16 form has no step to choose
    (VDPBF16PS is it) — and AMD's VDPBF16PS (Zen 4), like the Intel Xeon of family 6 model 207, adds such a product
    to a normal sum unflushed, as a fused multiply-add does, where the scalar form flushes it: these inputs tell such
    CPUs apart. Its fused rows (four or more, where they pay: forced on here) give VDPBF16PS's own bits on any CPU."""
    if kernels.form() not in ("avx512", "avx2", "avx512bf16") or (kernels.form() == "avx512bf16" and M < 4):
        pytest.skip(f"no fused step for {M} rows on this CPU ({kernels.form()})")
    with switched(kernels.set_fused_rows, True):
        check_fused_step_range(M)


def check_fused_step_range(M):
    reference = OP.invariant_linear_scalar
    if kernels.form() == "avx512bf16":  # (VDPBF16PS's own bits: the same call with the rows not fused)
        def reference(x, w, scale, bias, N):
            with switched(kernels.set_fused_rows, False):
                return OP.invariant_linear(x, OP.pack_weight(w), scale, bias, N)
    N, K = 16, 1024
    small, tiny = 2.0 ** -63, 2.0 ** -70  # 2^-63 · 2^-63 = 2^-126, fp32's least normal; 2^-63 · 2^-70 is below it
    x_out = torch.full((M, K), tiny).bfloat16()  # (M, K) out of range but for one value
    x_out[:, 1] = small
    w_out = torch.full((N, K), tiny).bfloat16()  # (N, K)
    w_out[:, 1] = small
    x_in, w_in = torch.full((M, K), small).bfloat16(), torch.full((N, K), small).bfloat16()
    for x, w in ((x_out, w_in), (x_in, w_out), (x_in, w_in)):
        want = reference(x, w, None, None, N)
        assert want.float().abs().min() > 0
        got = OP.invariant_linear(x, OP.pack_weight(w), None, None, N)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # a packed weight's copy is not known to be in range (unfused), a packed one as the engine keeps it is
    x, w, _ = operands(M, 64, 256)
    packed = OP.pack_weight(w)
    want = reference(x, w, None, None, 64)
    assert torch.equal(OP.invariant_linear(x, packed, None, None, 64), want)
    assert torch.equal(OP.invariant_linear(x, packed.clone(), None, None, 64), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_every_row_is_the_same_bits_alone_or_in_any_batch(M, N, K, dtype):
    """The property: a row's output never depends on the other rows — for whichever form this CPU runs (AMX tiles
    over packed weights, or lanes), bf16 and int8 weights, any number of rows, any offset, any thread count."""
    x, w, b = operands(M + 40, N, K, dtype=dtype)
    scale = torch.rand(N, generator=torch.Generator().manual_seed(1)) / 20 if dtype == torch.int8 else None
    tiles = OP.pack_weight(w)
    alone = torch.cat([OP.invariant_linear(x[i : i + 1], tiles, scale, b, N) for i in range(x.shape[0])])
    assert torch.isfinite(alone.float()).all()
    reference = x.float() @ (w.float() * (scale[:, None] if scale is not None else 1)).T + b.float()
    torch.testing.assert_close(alone.float(), reference, rtol=0.02, atol=0.05 * K**0.5)
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            for rows in (M, 2, 17, 31, 33):
                for start in (0, 40 - (rows % 40)):
                    got = OP.invariant_linear(x[start : start + rows], tiles, scale, b, N)
                    assert torch.equal(got, alone[start : start + rows]), (count, rows, start)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("Ns,K", [((1024, 256, 256), 1024), ((50, 7, 33, 16), 77), ((17, 40), 1100), ((768, 5), 31)])
def test_several_weights_in_one_call_are_each_the_bits_of_its_own_call(Ns, K, dtype):
    """invariant_linear_cat: [x W_0ᵀ, x W_1ᵀ, …] in one parallel region, each weight's columns exactly what a call
    over it alone gives — outputs not a multiple of 16, packed or (N, K), bf16 or int8, any rows, any threads."""
    weights = [operands(1, N, K, seed=j, dtype=dtype)[1] for j, N in enumerate(Ns)]
    scales = [torch.rand(N, generator=torch.Generator().manual_seed(j)) / 20 if dtype == torch.int8 else None
              for j, N in enumerate(Ns)]
    pad = 4 - len(Ns)
    threads = torch.get_num_threads()
    try:
        for count in {1, threads}:
            torch.set_num_threads(count)
            for forms in ([OP.pack_weight(w) for w in weights], weights):
                for M in (1, 3, 8, 65):
                    x = operands(M, 1, K, seed=M)[0]
                    alone = [OP.invariant_linear(x, w, s, None, N) for w, s, N in zip(forms, scales, Ns)]
                    together = OP.invariant_linear_cat(x, *forms, *[None] * pad, *scales, *[None] * pad, *Ns,
                                                       *[0] * pad)
                    assert together.shape == (M, sum(Ns))
                    assert torch.equal(together, torch.cat(alone, -1)), (count, M)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("pool", [False, True])
def test_every_task_runs_once_however_the_threads_share_them_out(pool):
    """A call's tasks start as one contiguous share a thread and a thread done first takes the rest of the others'
    from their ends (run_tasks): whatever the interleaving, every output is written, once, with its own bits. Two
    inputs in turn, so an output left unwritten would keep the other call's values (the allocator hands back the
    same block); three threads on two cores make the shares finish unevenly, as a busy host does — and on the
    kernels' own pool, a worker that is not running when a region opens misses it (its share taken by the rest)."""
    Ns, K = (1024, 1024, 512), 1024  # 160 groups of 16 outputs: many tasks a share
    weights = [OP.pack_weight(operands(1, N, K, seed=j)[1]) for j, N in enumerate(Ns)]
    inputs = [operands(M, 1, K, seed=M)[0] for M in (1, 1, 4)]
    inputs[1] = -inputs[1]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        wanted = [OP.invariant_linear_cat(x, *weights, None, *[None] * 4, *Ns, 0) for x in inputs]
        with switched(OP.use_work_pool, pool):
            for count in (2, 3):
                torch.set_num_threads(count)
                for call in range(200):
                    i = call % len(inputs)
                    got = OP.invariant_linear_cat(inputs[i], *weights, None, *[None] * 4, *Ns, 0)
                    assert torch.equal(got, wanted[i]), (count, call)
    finally:
        torch.set_num_threads(threads)


def test_callers_on_two_threads_share_the_pool_or_fall_back_with_the_same_bits():
    """The pool runs one caller's region at a time; a second thread asking meanwhile runs its region on OpenMP's
    threads instead — both threads' every call the bits of a one-thread call, however their calls interleave."""
    Ns, K = (1024, 512, 256), 1024
    weights = [OP.pack_weight(operands(1, N, K, seed=j)[1]) for j, N in enumerate(Ns)]
    inputs = [operands(M, 1, K, seed=10 + M)[0] for M in (1, 8)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wanted = [OP.invariant_linear_cat(x, *weights, None, *[None] * 4, *Ns, 0) for x in inputs]
    finally:
        torch.set_num_threads(threads)
    failures: list = []

    def caller(index: int) -> None:
        torch.set_num_threads(2)
        with switched(OP.use_work_pool, True):
            for call in range(300):
                got = OP.invariant_linear_cat(inputs[index], *weights, None, *[None] * 4, *Ns, 0)
                if not torch.equal(got, wanted[index]):
                    failures.append((index, call))

    pair = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in pair), "a caller hung"
    assert not failures, failures[:5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_rows_after_a_streaming_first_row_once_the_weights_outgrow_the_cache_are_the_same_bits(dtype):
    """Packed weights of more than one L3 stream from DRAM a decode step: then a call of at most 64 bf16 rows streams
    each group of outputs with its first row alone and takes the others in the blocked passes from the cache — up to
    16 rows a block of K at a time, the sums carried between blocks (faster on Zen 4; the AVX2 form: one row, bf16 or
    int8, and up to 8 bf16 rows or 6 int8 ones in single passes of up to 6 over a group's 16 outputs, faster on Zen
    3), else every row in the blocked passes — each row's bits the same every way (and with the streaming turned off),
    and the way follows the packed weights the process holds. Two shapes: rows in pairs over 8 outputs (K ≤ 1,024),
    and in sixes and fours over 4."""
    from linserve.model import kernels

    if kernels.form() not in ("avx512bf16", "avx512", "avx2"):
        pytest.skip(f"the lanes form over packed weights is not this CPU's ({kernels.form()})")
    assert kernels.streamed_rows() == 0  # (this process's packed weights so far fit the cache)
    counts = [*range(1, 14), 16, 17, 30]  # (every remainder of the blocked passes after the first row, fused 4s)
    shapes = []  # (N, K): a short last group of outputs, K's last block and chunk short
    for N, K in [(1040, 1000), (272, 1100)]:
        x, w, b = operands(40, N, K, dtype=dtype)
        scale = torch.rand(N, generator=torch.Generator().manual_seed(2)) / 20 if dtype == torch.int8 else None
        tiles = OP.pack_weight(w)
        cached = {rows: OP.invariant_linear(x[:rows], tiles, scale, b, N) for rows in counts}
        assert torch.equal(cached[30], lanes_reference(x[:30], w, scale, b))  # (the definition, cached)
        shapes.append((N, x, b, scale, tiles, cached))
    filler = [OP.pack_weight(torch.zeros(2048, 1024, dtype=torch.bfloat16))  # 4 MB each, past one L3
              for _ in range(kernels.last_level_cache_bytes() // (4 << 20) + 2)]
    assert kernels.streamed_rows() == 64
    threads = torch.get_num_threads()
    try:
        for N, x, b, scale, tiles, cached in shapes:
            for count in {1, threads}:
                torch.set_num_threads(count)
                for rows in counts:
                    for start in (0, 5):
                        got = OP.invariant_linear(x[start : start + rows], tiles, scale, b, N)
                        want = torch.cat([OP.invariant_linear(x[i : i + 1], tiles, scale, b, N)
                                          for i in range(start, start + rows)])
                        assert torch.equal(got, want), (N, count, rows, start)
                    assert torch.equal(OP.invariant_linear(x[:rows], tiles, scale, b, N), cached[rows]), (N, rows)
            with switched(kernels.set_streamed_rows, 0):  # every row blocked, streamed or not
                assert all(torch.equal(OP.invariant_linear(x[:rows], tiles, scale, b, N), cached[rows])
                           for rows in counts)
            with switched(kernels.set_fused_rows, True):  # (AVX512-BF16: the rows after the first fused, 4 at a time)
                assert all(torch.equal(OP.invariant_linear(x[:rows], tiles, scale, b, N), cached[rows])
                           for rows in counts)
    finally:
        torch.set_num_threads(threads)
    del filler
    assert kernels.streamed_rows() == 0  # their bytes went with them


def test_project_all_is_project_each_to_the_bit_and_one_call_per_four_weights(monkeypatch):
    layers = [torch.nn.Linear(96, N, bias=False).bfloat16() for N in (64, 64, 80, 16, 40)]
    x = operands(5, 1, 96)[0].view(5, 1, 96)
    calls = []
    original = torch.ops.linserve.invariant_linear_cat

    class Counting:  # (the op is looked up on torch.ops.linserve at each call)
        def __getattr__(self, name):
            if name == "invariant_linear_cat":
                return lambda *args: calls.append(args) or original(*args)
            return getattr(OP, name)

    with torch.no_grad():
        each = [numerics.project(layer, x) for layer in layers]
        monkeypatch.setattr(torch.ops, "linserve", Counting())
        together = numerics.project_all(layers, x)
    assert len(calls) == 1  # four weights in one call, the fifth alone
    assert [t.shape for t in together] == [t.shape for t in each]
    assert all(torch.equal(a, b) for a, b in zip(together, each))
    with_bias = [torch.nn.Linear(96, 32).bfloat16(), torch.nn.Linear(96, 32, bias=False).bfloat16()]
    with torch.no_grad():  # a bias: each alone (the kernel's call over several weights takes none)
        assert all(torch.equal(a, numerics.project(layer, x))
                   for a, layer in zip(numerics.project_all(with_bias, x), with_bias))


def test_the_kernel_refuses_what_it_cannot_compute_with_a_message():
    x, w, b = operands(2, 16, 32)
    with pytest.raises(RuntimeError, match="not \\(N, K\\)"):
        OP.invariant_linear(x, w, None, b, 17)
    with pytest.raises(RuntimeError, match="int8 weights take a scale"):
        OP.invariant_linear(x, w.to(torch.int8), None, b, 16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OP.invariant_linear(x.float(), w, None, b, 16)
    with pytest.raises(RuntimeError, match="share one form"):
        OP.invariant_linear_cat(x, w, OP.pack_weight(w.to(torch.int8)), None, None, None, torch.ones(16), None, None,
                                16, 16, 0, 0)


def test_numerics_linear_uses_the_kernel_over_weights_packed_once():
    x, w, b = operands(3, 48, 64)
    with torch.no_grad():
        first = numerics.linear(x, w, b)
        tiles, scale = projection.packed(w, projection.PACKERS["bf16"])
        assert projection.packed(w, projection.PACKERS["bf16"])[0] is tiles and scale is None  # once, not per call
        assert torch.equal(first, OP.invariant_linear(x, tiles, None, b, 48))
        assert any(weight is w for weight in projection.packed_weights())
