"""Loading a checkpoint (HF layout) onto a device; the one place that resolves `--device auto`."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # weights; the recurrent state is fp32 whatever this is
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPUs that compute bf16 dot products in hardware
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "default"  # ships inside the package


def resolve_device(name: str = "auto") -> torch.device:
    """auto → cuda when available, else cpu. Asking for cuda without a GPU is an error, not a fallback."""
    if name not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def cpu_computes_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has bf16 arithmetic in hardware (AVX512-BF16 or AMX-BF16; Linux's flags). Elsewhere
    bf16 weights are widened in software and cost more than they save."""
    try:
        with cpuinfo.open() as lines:
            flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def cpu_serves_bf16() -> bool:
    """Whether bf16 weights are this CPU's fast and batch-invariant configuration: bf16 arithmetic in hardware, or
    AVX512 or AVX2 without it where linserve's projection kernel runs its lanes in plain vector instructions (built
    here on first use: without a C++ compiler, bf16 there would be widened by oneDNN in software — float32 then).
    On the AVX2 form's Zen 3 host it served 1.77x fp32's tokens/s at 1 stream and 1.27x at 8, its 8,192-token
    prefill 1.05x fp32's time (docs/benchmarks.md, "The AVX2 lanes")."""
    if cpu_computes_bf16():
        return True
    from . import kernels

    return kernels.kernel_isa() in ("avx512", "avx2") and kernels.load()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weights' dtype: `auto` is bfloat16 on a CPU that serves it fast (`cpu_serves_bf16`), else float32 (CUDA
    keeps float32 until measured otherwise: its step is launch-bound, not bandwidth-bound — docs/benchmarks.md)."""
    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cpu" and cpu_serves_bf16() else torch.float32
    return getattr(torch, name)


def in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` itself when its weights are in `dtype` already, else a copy (eval mode) whose parameters are in
    `dtype` and whose buffers are not cast — as `from_pretrained(dtype=…)` loads them: a head's decay stays
    fp32, so the state decays exactly as the checkpoint says."""
    if next(model.parameters()).dtype == dtype:
        return model
    twin = copy.deepcopy(model).eval()
    for parameter in twin.parameters():  # each once: a tied head stays tied
        parameter.data = parameter.data.to(dtype)
    return twin


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32):
    """A LinearGPT checkpoint directory (config.json + model.safetensors) as its Hugging Face model
    (`LinearGPTForCausalLM`), in eval mode. (The server loads any family with checkpoint.load_checkpoint.)"""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    from transformers.utils import logging as hf_logging

    from .hf import LinearGPTForCausalLM

    hf_logging.disable_progress_bar()  # no "Loading weights" bar on every start
    lm = LinearGPTForCausalLM.from_pretrained(path, dtype=dtype)
    return lm.to(device).eval()
