"""Which form of linserve's kernels a CPU gets and how it is built (model/kernels/__init__.py): the form from the CPU's
flags or LINSERVE_KERNEL_ISA, int8 widened through AVX512-FP16 where the CPU's own form can, a compiler that refuses
that flag, and every form below this CPU's built and tested here."""

import os
import platform
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from linserve.model import kernels
from tests.helpers import require_kernel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def kernel_built():
    require_kernel()


def test_the_loaded_form_follows_the_cpu():
    assert kernels.form() == kernels.kernel_isa()  # (amx, avx512bf16, avx512, avx2 or scalar)
    if not os.environ.get(kernels.ISA_VARIABLE):
        assert kernels.form() == kernels.cpu_isa()


@pytest.mark.parametrize(("flags", "form"), [
    ("fpu sse avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16", "amx"),  # Sapphire Rapids
    ("fpu sse avx2 fma avx512f avx512bw avx512vl avx512_bf16", "avx512bf16"),  # Zen 4
    ("fpu sse avx2 fma avx512f avx512bw avx512vl", "avx512"),  # Skylake-SP to Ice Lake
    ("fpu sse avx avx2 fma bmi2", "avx2"),  # Zen 2/3, Haswell to Alder Lake
    ("fpu sse avx avx2", "scalar"),  # (AVX2 without FMA: no such CPU sells, but the form needs both)
    ("fpu sse sse4_2 avx", "scalar"),
])
def test_the_cpus_form_from_its_flags(tmp_path, flags, form):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert kernels.cpu_isa(str(info)) == (form if platform.machine() == "x86_64" else "scalar")


def test_the_kernel_form_asked_for_is_the_cpus_or_a_lower_one(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "cpu_isa", lambda: "avx512bf16")
    monkeypatch.delitem(kernels._state, "isa_warned", raising=False)
    monkeypatch.delenv(kernels.ISA_VARIABLE, raising=False)
    assert kernels.kernel_isa() == "avx512bf16"
    for asked, form in (("avx512", "avx512"), ("AVX2", "avx2"), (" Scalar ", "scalar"), ("avx512bf16", "avx512bf16"),
                        ("", "avx512bf16"), ("amx", "avx512bf16")):  # (above the CPU's: the CPU's, said once)
        monkeypatch.setenv(kernels.ISA_VARIABLE, asked)
        assert kernels.kernel_isa() == form
    assert "runs at most the avx512bf16 form" in caplog.text
    monkeypatch.setenv(kernels.ISA_VARIABLE, "sse4")
    with pytest.raises(ValueError,
                       match="LINSERVE_KERNEL_ISA='sse4': must be one of scalar, avx2, avx512, avx512bf16, amx"):
        kernels.kernel_isa()


LOWER_FORMS = kernels.ISAS[: kernels.ISAS.index(kernels.cpu_isa())]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # (the child's own 1,200 s governs: a form's build and its tests on a busy host)
@pytest.mark.skipif(not LOWER_FORMS, reason="the scalar form is this CPU's only one")
@pytest.mark.parametrize("form", LOWER_FORMS)
def test_each_lower_form_is_built_and_keeps_every_kernel_guarantee_on_this_cpu(form, tmp_path):
    """The forms a CPU with less would run (the plain-AVX512 lanes, the scalar code), each built here with
    LINSERVE_KERNEL_ISA and put through this module, the recurrence kernels' and the model's batch invariance in a
    child process (a process loads one form): every test passes and none is skipped for the form — so an AVX512-BF16
    or AMX CI host tests the forms of the CPUs it is not."""
    if os.environ.get(kernels.ISA_VARIABLE):
        pytest.skip("a child run of one form (its parent runs this)")
    report = tmp_path / "report.xml"
    tests = ["tests/model/test_kernels.py", "tests/model/test_kernel_forms.py", "tests/model/test_draw_kernel.py",
             "tests/model/test_recurrence_kernels.py",
             "tests/model/test_numerics.py::test_a_token_is_the_same_bits_whatever_the_split_the_form_or_the_batch",
             "tests/model/test_numerics.py::test_every_projection_of_the_shipped_shapes_gives_a_row_the_same_bits_in_any_batch"]
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-o", "addopts=",
                            f"--junitxml={report}", *tests], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                           env={**os.environ, kernels.ISA_VARIABLE: form})
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    cases = list(ElementTree.parse(report).getroot().iter("testcase"))
    skipped = {case.get("name"): case.find("skipped").get("message") for case in cases
               if case.find("skipped") is not None}
    assert "test_the_loaded_form_follows_the_cpu" in {case.get("name") for case in cases}  # (the form it loaded)
    # what may skip in a child: the parent's own runs, a CUDA case, and a test of another form (its reason names
    # the form it found)
    allowed = ("a child run", "cuda", f"({form})")
    assert all(any(word in why.lower() for word in allowed) for why in skipped.values()), skipped
    assert "test_the_loaded_form_follows_the_cpu" not in skipped


@pytest.mark.parametrize(("flags", "isa", "asked", "widens"), [
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_fp16 amx_tile amx_bf16", "amx", "", True),  # SPR
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_fp16", "avx512bf16", "", True),  # an SPR VM without AMX
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_fp16", "avx512bf16", "avx512bf16", False),  # a fleet's
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16", "avx512bf16", "", False),  # Zen 4/5: no AVX512-FP16
    ("avx2 fma avx512f avx512bw avx512vl avx512_bf16 avx512_fp16", "avx512", "", False),  # (the plain lanes)
])
def test_int8_is_widened_through_fp16_only_in_the_cpus_own_bf16_form(tmp_path, monkeypatch, flags, isa, asked,
                                                                      widens):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: fpu sse {flags}\n")
    monkeypatch.setenv(kernels.ISA_VARIABLE, asked)
    assert kernels.fp16_widening(isa, str(info)) == (widens and platform.machine() == "x86_64")


@pytest.mark.slow
def test_a_compiler_without_avx512_fp16_still_builds_the_kernel(tmp_path, monkeypatch, caplog):
    """Where fp16 widening is asked for but the compiler refuses -mavx512fp16 (older than GCC 12), the build drops
    the flag (int8 then widens through fp32: the same bits) instead of leaving the server without its kernel. A real
    compiler behind a wrapper that refuses the flag, a real build."""
    cxx = kernels.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    wrapper = tmp_path / "old-cxx"
    refuse = f'for a in "$@"; do [ "$a" = {kernels.FP16_FLAG} ] && exit 1; done'
    wrapper.write_text(f'#!/bin/sh\n{refuse}\nexec {cxx} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(kernels, "compiler", lambda: str(wrapper))
    monkeypatch.setattr(kernels, "fp16_widening", lambda isa, cpuinfo="/proc/cpuinfo": isa != "scalar")
    path = tmp_path / "kernels" / kernels.LIBRARY
    kernels.build(str(path), kernels.kernel_isa())
    assert path.exists()
    assert ("int8 widens through fp32 instead" in caplog.text) == (kernels.kernel_isa() != "scalar")
