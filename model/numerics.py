"""Batch-invariant numerics: bf16 inference on a CPU whose every rounding is fixed by the code.

A served token must not depend on what else is computed beside it — the batch, the bucket, how a prompt was
chunked, speculation, a session's turns — nor on which backend evaluates the step (torch's eager kernels or
the program Inductor compiles from the same code). Library kernels do not promise that: a reduction's order
is the kernel's choice (eager LayerNorm and Inductor's disagree in ~30% of fp32 outputs), eager `exp`/`tanh`
(MKL's VML) and Inductor's (SLEEF) differ in the last bit, a GEMM picks its kernel by the shape. In bf16,
where one rounding moves a value by 2⁻⁸, such a difference reaches the logits and flips near ties. So where
`exact_inference` holds — no autograd, bf16 activations on a CPU with oneDNN — the model computes only with:

- elementwise IEEE operations (+, -, ×, ÷, comparisons, casts): correctly rounded, the same bits on every
  backend (Inductor's C++ is built without floating-point contraction, so a·b + c stays two roundings);
- `sqrt` of fp32 values in float64, rounded once: torch's own fp32 kernel on a CPU is not correctly rounded
  (√7.8211155 came out 2.7966256, 1 ulp below the 2.7966259 Inductor's sqrtss gives — a q/k L2 norm of
  Gated DeltaNet differed between eager and compiled);
- reductions as `tree_sum`: a fixed pairwise tree of elementwise adds over slices — the code's order;
- functions of one bf16 value (GELU, ELU+1) as lookups in a 65,536-entry table of the float64 value,
  rounded once (`bf16_table`); `exp` of fp32 values in float64 (any two faithful float64 implementations
  round to the same float32 unless the exact value lies within ~2⁻²⁹ of a rounding boundary);
- matrix products through linserve's own kernel (`linear`, model/kernels/invariant_linear.cpp): each output one
  fixed sequence of roundings whatever the number of rows, the blocking or the threads — AMX tiles over weights
  packed once where the CPU has AMX, else bf16 dot-product lanes; a library GEMM picks its kernel by the shape
  (a plain bf16 GEMM switches kernels above 32 rows once K > 256) — checked for every projection shape by
  tests/model/test_numerics.py and tests/model/test_kernels.py (without a C++ compiler to build the kernel:
  oneDNN's inner product over weights packed for one row, whose rows were measured invariant too);
- linear attention's recurrence for every token in every form (linear_attention.scan).

Elsewhere (training, fp32 weights, CUDA) the model keeps torch's fused kernels and the chunked form: the same
function to rounding, not to the bit (fp32's rounding is 2⁻²⁴: measured outputs agree token for token, but
nothing guarantees it — docs/engine.md, "Same request, same tokens").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .projection import linear, linear_cat  # noqa: F401 - the projections' functions, part of this module's set


def exact_inference(x: torch.Tensor) -> bool:
    """Whether the model computes `x`'s layer with this module's functions: inference (no autograd) with bf16
    weights and activations on a CPU with oneDNN."""
    return (not torch.is_grad_enabled() and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and torch._C._has_mkldnn and not torch.is_autocast_enabled("cpu"))  # (autocast: fp32 weights)


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ over `dim` as a fixed pairwise tree: halves added elementwise (an odd last element rides along to
    the next level), so every backend adds in the same order. The dimension is removed."""
    dim = dim % x.dim()
    while x.shape[dim] > 1:
        size = x.shape[dim]
        half = size // 2
        summed = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
        x = torch.cat([summed, x.narrow(dim, 2 * half, 1)], dim) if size % 2 else summed
    return x.squeeze(dim)


_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def bf16_table(name: str, fn, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """fn of every bfloat16 value, evaluated in float64 and rounded once to out_dtype: (65536,) indexed by the
    input's bit pattern. A function of a bf16 tensor is then one lookup, the same bits on every backend.
    Made once per device, with real tensors even while a compiler traces (the table is a constant to it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, device, out_dtype)
    if key not in _TABLES:
        if torch.compiler.is_dynamo_compiling():
            raise RuntimeError(f"the {name} table for {device} must exist before Dynamo traces the model: "
                               "call linserve.model.numerics.prepare_tables(device) first")
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)  # every pattern, in index order
            values = bits.view(torch.bfloat16).double()  # (65536,)
            table = fn(values).to(out_dtype)  # (65536,)
            _TABLES[key] = table.roll(-32768).to(device)  # index i holds the value whose pattern is i (unsigned)
    return _TABLES[key]


def prepare_tables(device: torch.device | str) -> None:
    """Make every lookup table the model uses at inference on `device` (before a compiler traces it)."""
    from .feature_maps import elu1

    bf16_table("elu1", elu1, torch.float32, device)
    bf16_table("gelu_tanh", _gelu_tanh64, torch.bfloat16, device)
    for name, fn in ACTIVATIONS64.items():
        for dtype in (torch.bfloat16, torch.float32):
            bf16_table(name, fn, dtype, device)


ACTIVATIONS64 = {  # functions of one value, as float64 (the tables' source) — fla's ACT2FN names
    "silu": lambda h: h * torch.sigmoid(h),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "logsigmoid": F.logsigmoid,
    "relu": torch.relu,
    "sqrelu": lambda h: torch.relu(h) ** 2,
    "gelu": lambda h: _gelu_tanh64(h),
    "elu1": lambda h: torch.where(h > 0, h + 1.0, torch.exp(torch.clamp(h, max=0.0))),  # DeltaNet's elu_p1
}
ACTIVATIONS64["swish"] = ACTIVATIONS64["silu"]
POWLU_POWER = 3.0  # fla's GatedMLP default (not a config field)
# fla's PowGLU gate: x^(p / (√x + 1))·σ(x) above 0, SiLU below
ACTIVATIONS64["powlu"] = lambda h: torch.where(
    h > 0, torch.where(h > 0, h, 1.0) ** (POWLU_POWER / (torch.where(h > 0, h, 1.0).sqrt() + 1)) * torch.sigmoid(h),
    h * torch.sigmoid(h))


def activation(name: str, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """An ACTIVATIONS64 function of x: a `bf16_table` lookup where `exact_inference` (rounded once to
    `out_dtype`, x's dtype by default), else computed by torch in x's dtype and then cast."""
    out_dtype = out_dtype or x.dtype
    if exact_inference(x):
        return lookup(bf16_table(name, ACTIVATIONS64[name], out_dtype, x.device), x)
    if name in ("silu", "swish"):
        y = F.silu(x)
    elif name == "powlu":
        y = ACTIVATIONS64["powlu"](x.float())
    elif name == "gelu":
        y = F.gelu(x, approximate="tanh")
    else:
        y = ACTIVATIONS64[name](x)
    return y.to(out_dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, exact: bool,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension in fp32 — x·(mean(x²) + eps)^-½·w — with a tree sum and a correctly
    rounded sqrt when `exact` (the layer's input was `exact_inference`), else torch's kernels; returned in
    `out_dtype` (x's by default)."""
    h = x.float()  # (..., C)
    if exact:
        mean_square = tree_sum(h * h, -1)[..., None] / h.shape[-1]  # (..., 1)
        y = h / sqrt(mean_square + eps)  # (..., C)
    else:
        y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # (..., C)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype or x.dtype)


def lookup(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table (65536,) at x's bf16 bit patterns: (...) in the table's dtype. A bf16 x is read as its 16-bit
    pattern directly: Inductor makes that a plain scalar loop, where the same index through fp32's bits (shift,
    mask) became int64 vectors — ~10x slower a lookup (docs/engine.md, "Lookups")."""
    if x.dtype == torch.bfloat16:
        index = x.view(torch.int16).to(torch.int32) & 0xFFFF  # (...) unsigned pattern
    else:
        index = (x.float().view(torch.int32) >> 16) & 0xFFFF  # (...) the pattern of x's bf16 truncation
    return table[index]


def flush_subnormals() -> None:
    """This thread's CPU float ops treat subnormal numbers as 0 (FTZ/DAZ). Decays of strongly forgetting
    heads (Gated DeltaNet, GLA) underflow into subnormals, which CPUs compute ~10× slower; a value below
    1.2e-38 changes nothing a bf16 or fp32 result can show. The engine's thread sets it (per thread: OpenMP's
    workers and other threads keep their own setting)."""
    torch.set_flush_denormal(True)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """√x in float64, rounded to x's dtype (float32): correctly rounded from any backend (float64's sqrt is,
    and rounding its result to float32 is innocuous)."""
    return torch.sqrt(x.double()).to(x.dtype)


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp in float64, rounded to x's dtype (float32 or wider): the same bits from any backend."""
    return torch.exp(x.double()).to(x.dtype)


SOFTPLUS_THRESHOLD = 20.0  # torch's: above it softplus(x) is x


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + eˣ) of fp32 values in float64, rounded once to float32 (x itself above torch's threshold of 20):
    the same bits from any backend, as `exp`."""
    h = x.double()
    return torch.where(h > SOFTPLUS_THRESHOLD, h, torch.log1p(torch.exp(h))).to(torch.float32)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension, computed in fp32 with tree sums and returned in x's dtype."""
    h = x.float()  # (..., C)
    n = h.shape[-1]
    mean = tree_sum(h, -1)[..., None] / n  # (..., 1)
    centred = h - mean  # (..., C)
    var = tree_sum(centred * centred, -1)[..., None] / n  # (..., 1)
    y = centred / sqrt(var + eps) * weight.float()  # (..., C)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


GELU_SCALE = math.sqrt(2.0 / math.pi)


def _gelu_tanh64(h: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, 0.5·h·(1 + tanh(√(2/π)·(h + 0.044715·h³))), of float64 values."""
    return 0.5 * h * (1.0 + torch.tanh((h + 0.044715 * (h * h * h)) * GELU_SCALE))


def project(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A Linear module's function: `linear` where `exact_inference`, else the module itself."""
    return linear(x, layer.weight, layer.bias) if exact_inference(x) else layer(x)


def project_all(layers: list[torch.nn.Linear], x: torch.Tensor) -> list[torch.Tensor]:
    """Several Linear modules over the same x: where `exact_inference` and none has a bias, one kernel call for
    them all (`linear_cat`: each output the bits `project` gives it); else `project` each."""
    if exact_inference(x) and all(layer.bias is None for layer in layers):
        return linear_cat(x, [layer.weight for layer in layers])
    return [project(layer, x) for layer in layers]


def normalize(layer: torch.nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm module's function: `layer_norm` where `exact_inference`, else torch's kernel."""
    return layer_norm(x, layer.weight, layer.bias, layer.eps) if exact_inference(x) else layer(x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh approximation): a `bf16_table` lookup where `exact_inference`, else torch's kernel."""
    if exact_inference(x):
        return lookup(bf16_table("gelu_tanh", _gelu_tanh64, torch.bfloat16, x.device), x)
    return F.gelu(x, approximate="tanh")
