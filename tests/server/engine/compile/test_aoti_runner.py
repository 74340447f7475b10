"""Compiled CPU buckets called through AOTInductor's C ABI (the GIL released): the same outputs as torch's own
loader, the GIL really released while a program runs, and torch's loader where the ABI path cannot open it."""

from __future__ import annotations

import ctypes
import os
import zipfile

import pytest
import torch

from linserve.server.engine.compile import aoti_runner
from linserve.server.engine.compile.aoti_runner import ReleasingProgram, load_program
from linserve.server.engine.decode_program import DECODE
from tests.server.engine.compile.test_compiled_decode import BUILD_WAIT_S, make_step, pool_with_history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUILD_WAIT_S + 600)]


@pytest.fixture(scope="module")
def built(tiny_model, compile_cache, device):
    """The tiny model's bucket 1 (the one test_compiled_decode builds: one cache) and its inputs."""
    if device.type != "cpu":
        pytest.skip("AOTInductor artifacts are the CPU path (CUDA runs graphs of the compiled program)")
    pool = pool_with_history(tiny_model, 2, device)
    step = make_step(tiny_model, pool, device, "on", max_rows=1, cache_dir=compile_cache)
    step.start()
    assert step.wait_compiled(BUILD_WAIT_S) and step.status == "compiled", step.status
    (package,) = [os.path.join(step.cache_dir, name) for name in os.listdir(step.cache_dir)
                  if name.endswith("-b1.pt2") and name.startswith(f"decode-s{pool.num_slots}-")]
    io = torch.tensor([[17], [1], [40]], dtype=torch.long)  # (3, 1): token, slot, position
    return step, package, step._inputs(io)


def fresh(inputs: tuple) -> list:
    """The arguments with copies of the pool's buffers: a decode program writes its rows' state into them."""
    return [tensor.clone() for tensor in inputs]


def by_ctypes(program: ReleasingProgram) -> ReleasingProgram:
    """The same program called with its handles made in Python (the path where linserve's kernels are absent)."""
    program._in_cpp = None
    return program


@pytest.mark.parametrize("handles", ["c++", "ctypes"])
def test_the_step_uses_the_releasing_program_and_matches_torch_loader(built, handles):
    step, package, inputs = built
    assert isinstance(step._ready[1].step, ReleasingProgram)
    assert step._ready[1].step._in_cpp is not None  # the kernels are loaded here: handles made in C++
    mine, torchs = fresh(inputs), fresh(inputs)
    ours = (ReleasingProgram(package) if handles == "c++" else by_ctypes(ReleasingProgram(package)))(*mine)
    theirs = torch._inductor.aoti_load_package(package)(*torchs)
    assert len(ours) == len(theirs) == 7  # tokens … redraw, table (the new state is written into the pool)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    buffers = slice(3, 3 + len(step.buffers))  # after token, slot, position
    assert step.pending, "the shipped model's states are folded on the CPU kernels"
    pending = slice(len(inputs) - len(step.pending), len(inputs))  # k, u, alpha, flag a state: after the sampling
    for a, b, before in zip(mine[buffers] + mine[pending], torchs[buffers] + torchs[pending],
                            inputs[buffers] + inputs[pending], strict=True):
        assert torch.equal(a, b)  # both noted slot 1's update as pending (its read applies the one before)
        assert torch.equal(a[0], before[0])  # slot 0 untouched
    assert all(int(flag[1]) in (1, 2) for flag in mine[pending][3::4])  # an update pending on slot 1


def test_a_run_the_program_refuses_raises_and_the_next_run_is_exact(built):
    """The container checks its inputs: a call it refuses raises a Python error naming what is wrong (no crash of
    the process), and the program serves the next call as before."""
    _, package, inputs = built
    program = ReleasingProgram(package)
    with pytest.raises(RuntimeError, match="inputs vector size"):
        program(*fresh(inputs)[:-1])  # one input short
    logits = DECODE.logits_output
    assert torch.equal(program(*fresh(inputs))[logits], by_ctypes(ReleasingProgram(package))(*fresh(inputs))[logits])


def test_the_run_entry_point_releases_the_gil(built):
    """The program is called as a plain foreign function (ctypes CDLL), which releases the GIL for the call —
    unlike a PyDLL function or torch's loader (a pybind call that keeps it) — or from linserve's op, which torch.ops
    calls with the GIL released: the mechanism, not a timing (the effect is measured in docs/engine.md, "Threads")."""
    _, package, inputs = built
    program = ReleasingProgram(package)
    assert type(program.library) is ctypes.CDLL
    assert not program._run._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # PYTHONAPI functions keep the GIL
    assert program._in_cpp is torch.ops.linserve.run_program.default  # an op call: the GIL released around it
    for _ in range(3):  # handles are made and taken on every call: repeated calls stay exact
        again = program(*fresh(inputs))
        logits = DECODE.logits_output
        assert torch.equal(again[logits], by_ctypes(ReleasingProgram(package))(*fresh(inputs))[logits])


def test_a_bound_program_takes_the_io_rows_alone_and_computes_the_same(built):
    """The step's bucket is bound to its unchanging inputs (the pool's buffers, the sampling tables, the pending
    updates): called with the io rows alone, it gives the outputs and writes the pool as a call with every input
    does; repeated calls stay exact, and once the binding goes its number is refused."""
    step, package, inputs = built
    assert step._ready[1].bound is not None  # the engine's step calls its bucket bound
    leading = len(DECODE.arguments(torch.zeros(3, 1, dtype=torch.long)))
    for _ in range(2):
        full, tail = fresh(inputs), fresh(inputs)[leading:]
        bound = ReleasingProgram(package).bind(tuple(tail))
        again_tail = fresh(inputs)[leading:]
        ours, theirs = bound(*inputs[:leading]), ReleasingProgram(package)(*full)
        by_rows = ReleasingProgram(package).bind(tuple(again_tail)).rows([17, 1, 40], 3, (0, 0, 1, 0, 2, 0))
        assert len(ours) == len(theirs) == len(by_rows) == 7
        for a, b, c in zip(ours, theirs, by_rows):
            assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
            assert torch.equal(a, b) and torch.equal(a, c)
        for a, b, c in zip(tail, full[leading:], again_tail, strict=True):  # the same state noted pending, counts
            assert torch.equal(a, b) and torch.equal(a, c)
        assert any(not torch.equal(a, b) for a, b in zip(tail, inputs[leading:]))  # (the bound tensors written)
    number = bound.binding
    del bound
    with pytest.raises(RuntimeError, match=f"no program bound as {number}"):
        torch.ops.linserve.run_bound(number, list(inputs[:leading]))
    with pytest.raises(RuntimeError, match="rows 2 \\+ 1 of 2"):  # spans past the rows given: refused, not read
        torch.ops.linserve.run_bound_rows(number, [17, 1], 2, [2, 0])
    assert by_ctypes(ReleasingProgram(package)).bind(tuple(inputs[leading:])) is None  # no kernels: no binding


def test_a_package_without_a_library_falls_back_to_torch_loader(tmp_path, monkeypatch, built, caplog):
    _, package, inputs = built
    broken = tmp_path / "broken.pt2"
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(broken, "w") as out:
        for name in source.namelist():
            if not name.endswith(".so"):
                out.writestr(name, source.read(name))
    calls = []
    monkeypatch.setattr(aoti_runner.torch._inductor, "aoti_load_package", lambda path: calls.append(path) or "loaded")
    assert load_program(str(broken)) == "loaded" and calls == [str(broken)]
    assert "through torch's loader" in caplog.text
    assert not [p for p in os.listdir(os.path.dirname(package)) if p.endswith(".so")]  # nothing left on disk


def test_loading_a_program_asks_linux_for_the_amx_tile_state(built):
    """A fresh process that loads an artifact may run AMX tile instructions (max-autotune's GEMM kernels) before
    oneDNN ever asked Linux for the tile state: loading asks (else SIGILL at the first `tilezero`)."""
    import subprocess
    import sys

    _, package, _ = built
    check = f"""
import ctypes, torch
from linserve.server.engine.compile.aoti_runner import load_program
def granted():
    features = ctypes.c_uint64()  # arch_prctl(ARCH_GET_XCOMP_PERM): the state components this process may use
    ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(features))
    return bool(features.value & (1 << 18))  # XFEATURE_XTILEDATA
supported = " amx_tile" in open("/proc/cpuinfo").read()
before = granted()
load_program({package!r})
print(supported, before, granted())
"""
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    supported, before, after = result.stdout.split()[-3:]
    if supported == "False":
        pytest.skip("no AMX on this CPU: nothing to ask for")
    assert (before, after) == ("False", "True")
