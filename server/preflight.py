"""Checks `linserve serve` makes before anything heavy loads: each failure is one clear line (ValueError).

Order matters for the user: the port (instant) and the model directory come before torch is imported, so
a busy port or a typo in `--model` is reported at once, not after seconds of loading. The checks that need torch
(`check_engine`) run where the engine loads: in this process, or first thing in the engine core's.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from .settings import Settings

CHECKPOINT_FILES = ("config.json", "model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "rwkv_vocab_v20230424.txt")  # a Rust tokenizer, or RWKV's world vocabulary


def check_port(host: str, port: int) -> None:
    """Fail if nothing could listen on host:port now (uvicorn binds the same way, with SO_REUSEADDR)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: cannot resolve it ({error.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            hint = " (is another server running there? choose another --port)" if error.errno == 98 else ""
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}{hint}") from None


def check_checkpoint(model: str | None, files: tuple[str, ...] = CHECKPOINT_FILES,
                     tokenizer_files: tuple[str, ...] = TOKENIZER_FILES) -> None:
    """`--model` names a directory holding `files` and one of `tokenizer_files` (None: the shipped checkpoint,
    always there)."""
    if model is None:
        return
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"--model {model}: no such directory")
    missing = [name for name in files if not (path / name).is_file()]
    if tokenizer_files and not any((path / name).is_file() for name in tokenizer_files):
        missing.append(" or ".join(tokenizer_files))
    if missing:
        raise ValueError(f"--model {model}: not a checkpoint directory (missing {', '.join(missing)})")


GPU_DRIVER_SIGNS = ("/proc/driver/nvidia/version", "/dev/nvidia0", "/dev/kfd")  # NVIDIA, ROCm


def check_gpu_driver(device: str) -> None:
    """`--device cuda` on a machine with no GPU driver at all fails at once (torch would take seconds to say so)."""
    if (
        device == "cuda"
        and not any(Path(sign).exists() for sign in GPU_DRIVER_SIGNS)
        and not shutil.which("nvidia-smi")
    ):
        raise ValueError("--device cuda was asked for, but no CUDA device is available (no GPU driver found)")


def preflight(settings: Settings) -> None:
    """Every check, in `serve`'s process — except the engine's when the engine core runs in a process of its own
    (`api_servers` >= 1): that process makes them first thing (engine_process/core_main.py), so the HTTP side never
    imports torch (engine/client.py)."""
    check_port(settings.host, settings.port)
    check_checkpoint(settings.model)
    check_gpu_driver(settings.device)
    if not settings.engine_placement():
        check_engine(settings)


def check_engine(settings: Settings) -> None:
    """What needs torch: the device, the checkpoint itself, the kernel form asked for, int8 weights where they can
    run."""
    from linserve.model import kernels, projection
    from linserve.model.loading import resolve_device, resolve_dtype  # imports torch

    device = resolve_device(settings.device)  # --device cuda without a GPU: a ValueError saying so
    check_model(settings.model)
    if device.type == "cpu":
        kernels.kernel_isa()  # LINSERVE_KERNEL_ISA naming no kernel form: a ValueError saying which exist
    # int8 where it cannot run (fp32, CUDA, no kernel): said here, not as a failed start-up
    projection.use_quantization(settings.quantization, device, resolve_dtype(settings.dtype, device))


def check_model(model: str | None) -> None:
    """The directory is a complete, consistent checkpoint of a served family — config.json's type and every
    option, every weight by name and shape, a readable file, a tokenizer of the model's vocabulary — or a
    ValueError naming what is not (model/checkpoint.py): nothing starts with random or missing weights."""
    from linserve.model.checkpoint import load_tokenizer, validate
    from linserve.model.loading import DEFAULT_CHECKPOINT

    path = Path(model) if model is not None else DEFAULT_CHECKPOINT
    try:
        tokenizer = load_tokenizer(path)
    except Exception as error:  # noqa: BLE001 - transformers raises many kinds for a broken tokenizer
        raise ValueError(f"--model {path}: the tokenizer cannot be loaded: {error}") from None
    validate(path, tokenizer)
