"""The projections (x Wᵀ + b) of exact inference: linserve's batch-invariant kernel over weights packed once.

`linear` is every projection's function where `numerics.exact_inference` holds: each output one fixed sequence of
roundings whatever else shares the call (model/kernels/invariant_linear.cpp); `linear_cat` runs several weights
over one input (a layer's q, k and v) in one call, each output the same bits. A weight is packed for the kernel
once, on first use, and kept beside it (`packed`); a compiled program holds the packed form as its own constant
(`traced_tiles`, set by the program compiler). The weights' format is process-wide (`set_weight_format`):

- "bf16" (the default): the checkpoint's weights in bf16, packed into AMX tiles (or read as they are);
- "int8": weight-only int8 — per output channel, scale = max|w| / 127 and q = round(w / scale) in fp32, made
  from the served bf16 weights at first use — widened to bf16 exactly inside the kernel and scaled after the
  reduction: y = bf16(Σ x·q · scale + b). The same invariance; half the bytes a decode step reads.

Without the kernel (no C++ compiler, or LINSERVE_KERNELS=off): oneDNN's inner product over weights packed for
one row, bf16 only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import kernels

WEIGHT_FORMATS = ("bf16", "int8")
_format = {"weights": "bf16"}


def set_weight_format(name: str) -> None:
    """The projections' weight format for this process ("bf16" or "int8"; see the module's docstring)."""
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}: one of {', '.join(WEIGHT_FORMATS)}")
    if name == "int8" and not kernels.load():
        raise ValueError(f"int8 weights need linserve's projection kernel, unavailable here: {kernels.load_error()}")
    _format["weights"] = name


def use_quantization(quantization: str, device: torch.device, dtype: torch.dtype) -> None:
    """The `quantization` setting ("none" or "int8") for a model served on `device` in `dtype`: int8 needs bf16
    weights on a CPU (exact inference) — refused with a ValueError otherwise."""
    if quantization == "int8" and (device.type != "cpu" or dtype != torch.bfloat16):
        raise ValueError(f"--quantization int8 needs bf16 weights on a CPU (here: {dtype} on {device.type})")
    set_weight_format("int8" if quantization == "int8" else "bf16")


def weight_format() -> str:
    return _format["weights"]


def describe() -> dict:
    """How this process's projections run (for /version and the logs)."""
    return {"kernel": kernels.form() if kernels.load() else "onednn", "weights": weight_format()}


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) → (q int8 (N, K), scale fp32 (N,)): symmetric per output channel, round to nearest even."""
    w = weight.float()  # (N, K)
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (N,)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    return q, scale


def _kernel_form(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the kernel reads it: AMX tiles where it packs them, else (N, K) as it is (no copy)."""
    return torch.ops.linserve.pack_weight(weight) if kernels.PACKS_TILES else weight.contiguous()


def _tiles_bf16(weight: torch.Tensor) -> tuple[torch.Tensor, None]:
    return _kernel_form(weight), None


def _tiles_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_int8(weight)
    return _kernel_form(q), scale


PACKERS = {"bf16": _tiles_bf16, "int8": _tiles_int8}


def as_inputs(entries) -> list[torch.Tensor]:
    """Packed forms — (tiles, scale or None) each — as a compiled program's trailing inputs, in order: the tiles,
    then the scale where there is one."""
    return [t for entry in entries for t in entry if t is not None]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b with every row the same bits whatever else is in x. x (..., K) bf16; weight (N, K) bf16 → (..., N).
    Eager and compiled alike, one `invariant_linear` call over the weight's packed form."""
    if kernels.load():
        tiles, scale = _entry(weight)  # (compiling: the program's own packed constants, traced_tiles)
        return torch.ops.linserve.invariant_linear(x, tiles, scale, bias, weight.shape[0])
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight, _onednn_one_row), bias, "none", [], "")


CAT_WEIGHTS = 4  # weights one kernel call reads at most (linear_cat)


def linear_cat(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x W_0ᵀ, x W_1ᵀ, …] for weights without biases over one x — each output the bits `linear` gives it — in one
    kernel call per four weights: one parallel region (one fork and join of the threads) where separate calls
    would make one each. Views into one (..., ΣN) output. Without the kernel: `linear` each."""
    if not kernels.load():
        return [linear(x, weight) for weight in weights]
    outputs = []
    for start in range(0, len(weights), CAT_WEIGHTS):
        part = weights[start:start + CAT_WEIGHTS]
        if len(part) == 1:
            outputs.append(linear(x, part[0]))
            continue
        entries = [_entry(weight) for weight in part] + [(None, None)] * (CAT_WEIGHTS - len(part))
        sizes = [weight.shape[0] for weight in part] + [0] * (CAT_WEIGHTS - len(part))
        y = torch.ops.linserve.invariant_linear_cat(x, *(tiles for tiles, _ in entries),
                                                    *(scale for _, scale in entries), *sizes)  # (..., ΣN)
        outputs.extend(y.split(sizes[:len(part)], dim=-1))
    return outputs


def _entry(weight: torch.Tensor) -> tuple:
    """(the weight's packed form, its int8 scale or None): the traced program's own while one is compiled."""
    if torch.compiler.is_compiling():
        return _TRACED_TILES.get(id(weight)) or PACKERS[weight_format()](weight)
    return packed(weight, PACKERS[weight_format()])


_TRACED_TILES: dict[int, tuple] = {}  # while a program is traced: id(weight) → (tiles, scale or None)


@contextlib.contextmanager
def traced_tiles(tiles: dict[int, tuple]):
    """While a compiler traces: each weight's packed form as the program's own tensors (buffers the program holds,
    so they become constants packed once at build time) — `tiles` maps id(the weight as traced) to them."""
    _TRACED_TILES.update(tiles)
    try:
        yield
    finally:
        for key in tiles:
            _TRACED_TILES.pop(key, None)


def packed_weights() -> list[torch.Tensor]:
    """The weights packed for the kernel so far in this process: those the model's projections used."""
    return [weight for weight, hit in _PACKED.items() if hit[1] in PACKERS.values()]


def _onednn_one_row(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


_PACKED = WeakIdKeyDictionary()  # weight → (its version when packed, how, the packed form)


def packed(weight: torch.Tensor, pack):
    """`pack(weight)` (a kernel's form of `weight` (N, K)), made once per weight (again if the weight is written in
    place or the format changes), dropped with it."""
    version = 0 if weight.is_inference() else weight._version  # (an inference tensor keeps no version count)
    hit = _PACKED.get(weight)
    if hit is None or hit[0] != version or hit[1] is not pack:
        if released(weight):
            raise RuntimeError(f"a projection weight {tuple(weight.shape)} was released after packing "
                               "(weights.keep_one_copy): it cannot be packed again in another form")
        hit = (version, pack, pack(weight.detach()))
        _PACKED[weight] = hit
    return hit[2]


_RELEASED = WeakIdKeyDictionary()  # a weight whose original was dropped → True


def released(weight: torch.Tensor) -> bool:
    """Whether `weight`'s original values were dropped (release_original): only its packed form holds them."""
    return weight in _RELEASED


def release_original(weight: torch.Tensor) -> int:
    """Keep only `weight`'s packed form (in this process's format): the original's storage becomes one NaN
    element expanded to its shape (shape, dtype and device unchanged); the bytes freed."""
    packed(weight, PACKERS[weight_format()])
    freed = weight.untyped_storage().nbytes()
    weight.data = torch.full((), float("nan"), dtype=weight.dtype, device=weight.device).expand(weight.shape)
    _RELEASED[weight] = True
    return freed
