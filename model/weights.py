"""A served model's weights as a process holds them: one copy, and a digest that names them.

The projection kernel reads each projection weight in its packed form (projection.packed: AMX tiles, or int8 with
scales), made once at first use. Kept beside it, the checkpoint's own (N, K) tensor would be a second copy that
nothing reads again — a 340M model's 0.68 GB. `keep_one_copy` drops those originals once every projection has been
packed: each released weight keeps its shape, dtype and device (what the engine, the thread plan and /v1/models
read) over a one-element NaN storage, so a reader that should not read it any more gets NaNs, never a stale value.

What still needs the values asks here: `content_digest` (the compile cache's key, a session snapshot's model
fingerprint) is computed before the release and remembered; `state_dict_for_compiler` gives the compiler child
zeros in place of a released weight — a program takes its projections' packed weights as inputs, so the child
never reads their values (program_compiler.build).
"""

from __future__ import annotations

import hashlib
import json
from weakref import WeakKeyDictionary

import torch

from . import kernels, projection
from .projection import released

_DIGESTS: WeakKeyDictionary = WeakKeyDictionary()  # model → sha256 of its config and weights


def content_digest(model: torch.nn.Module) -> "hashlib._Hash":
    """sha256 over the model's config and every tensor of its state dict (names and bytes), computed once per
    model: a copy each call (the caller may add to it)."""
    digest = _DIGESTS.get(model)
    if digest is None:
        digest = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
        for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            if released(tensor):
                raise RuntimeError(f"{name}: its original was released before the model's digest was taken")
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        _DIGESTS[model] = digest
    return digest.copy()


def keep_one_copy(model: torch.nn.Module) -> int:
    """Drop the original of every projection weight the kernel reads packed, once packed; the bytes freed. Only
    where the kernel serves the projections (bf16 weights on a CPU with the kernel built): elsewhere the original
    is the one copy. A weight that is also read as itself — a head tied to the embedding — is kept. Finds the
    projection weights by running the model once on two tokens (each projection packs its weight then); takes
    the model's digest first."""
    parameter = next(model.parameters(), None)
    if (parameter is None or parameter.device.type != "cpu" or parameter.dtype != torch.bfloat16
            or not kernels.load()):
        return 0
    content_digest(model)
    with torch.inference_mode():
        model(torch.zeros(1, 2, dtype=torch.long))
    packed = {id(weight) for weight in projection.packed_weights()}
    kept = {id(weight) for weight in read_as_themselves(model)}
    freed = 0
    for weight in model.parameters():
        if id(weight) not in packed or id(weight) in kept or released(weight):
            continue
        freed += projection.release_original(weight)
    return freed


def read_as_themselves(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights the model reads as they are, not (only) through a projection: its embedding tables (a head
    tied to one is both)."""
    return [module.weight for module in model.modules() if isinstance(module, torch.nn.Embedding)]


def state_dict_for_compiler(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU, a released weight as zeros of its shape (one stored element)."""
    return {name: (torch.zeros((), dtype=tensor.dtype).expand(tensor.shape) if released(tensor)
                   else tensor.detach().cpu()) for name, tensor in model.state_dict(keep_vars=True).items()}
