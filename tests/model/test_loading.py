"""Loading: the weights' dtype `auto` resolves from what the CPU computes in hardware and which kernel form it runs."""

from __future__ import annotations

import pytest
import torch

from linserve.model.loading import (
    DEFAULT_CHECKPOINT,
    cpu_computes_bf16,
    cpu_serves_bf16,
    in_dtype,
    load_model,
    resolve_dtype,
)


def cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return path


@pytest.mark.parametrize(("flags", "native"), [
    ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni", True),  # Zen 4, Cooper Lake
    ("fpu avx512f amx_tile amx_bf16 amx_int8", True),  # Sapphire Rapids
    ("fpu sse avx2 avx512f avx512_vnni", False),  # AVX-512 without bf16: widened in software
    ("fpu sse avx2", False),
])
def test_native_bf16_from_the_cpu_flags(tmp_path, flags, native):
    assert cpu_computes_bf16(cpuinfo(tmp_path, flags)) is native


def test_unreadable_cpuinfo_is_not_native(tmp_path):
    assert cpu_computes_bf16(tmp_path / "absent") is False


def test_bf16_is_served_where_the_kernels_lanes_run_in_vector_registers(monkeypatch):
    """bf16 in hardware; else AVX512 or AVX2 with linserve's kernel built (its lanes in plain vector instructions: the
    same bits, half the bytes of fp32); else — neither, or no compiler to build the kernel (oneDNN would widen bf16 in
    software) — not."""
    from linserve.model import kernels, loading

    monkeypatch.setattr(loading, "cpu_computes_bf16", lambda: False)
    monkeypatch.setattr(kernels, "load", lambda: True)
    for isa, served in (("avx512", True), ("avx2", True), ("scalar", False)):
        monkeypatch.setattr(kernels, "cpu_isa", lambda isa=isa: isa)
        assert cpu_serves_bf16() is served
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx512")
    monkeypatch.setattr(kernels, "load", lambda: False)
    assert cpu_serves_bf16() is False
    monkeypatch.setattr(loading, "cpu_computes_bf16", lambda: True)
    assert cpu_serves_bf16() is True


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32 and resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("auto", cpu) is (torch.bfloat16 if cpu_serves_bf16() else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.float32  # resolved without touching a GPU
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float16", cpu)


def test_in_dtype_casts_a_copys_parameters_not_its_buffers_as_from_pretrained_loads():
    """The decode copy of the shipped model equals `from_pretrained(dtype=bfloat16)`, byte for byte (its heads'
    decays stay fp32), so `linserve compile` and `serve` build and find the same artifacts."""
    model = load_model(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.float32).model
    assert in_dtype(model, torch.float32) is model
    copy = in_dtype(model, torch.bfloat16)
    assert copy is not model and next(model.parameters()).dtype == torch.float32 and not copy.training
    loaded = load_model(DEFAULT_CHECKPOINT, torch.device("cpu"), torch.bfloat16).model.state_dict()
    mine = copy.state_dict()
    assert {name: t.dtype for name, t in mine.items()} == {name: t.dtype for name, t in loaded.items()}
    assert all(torch.equal(mine[name], loaded[name]) for name in loaded)
    assert {t.dtype for name, t in mine.items() if name.endswith("log_decay")} == {torch.float32}
