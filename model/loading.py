"""Loading a checkpoint (HF layout) onto a device; the one place that resolves `--device auto`."""

from __future__ import annotations

from pathlib import Path

import torch

from .hf import LinearGPTForCausalLM

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("float32", "bfloat16")  # weights; the recurrent state is fp32 whatever this is
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


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32) -> LinearGPTForCausalLM:
    """Load a LinearGPT checkpoint directory (config.json + model.safetensors) in eval mode."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar on every start
    lm = LinearGPTForCausalLM.from_pretrained(path, dtype=dtype)
    return lm.to(device).eval()
