"""Loading: the weights' dtype `auto` resolves from what the CPU computes in hardware."""

from __future__ import annotations

import pytest
import torch

from linserve.model.loading import cpu_computes_bf16, resolve_dtype


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


def test_resolve_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32 and resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("auto", cpu) is (torch.bfloat16 if cpu_computes_bf16() else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.float32  # resolved without touching a GPU
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("float16", cpu)
