"""The projection kernel per call, against the DRAM floor and the kernels it replaced (issue 55, item 1).

For each projection shape of the shipped model and of fla's 340M models, at M = 1, 8 and 512 rows (decode, 8
streams, a prefill chunk): linserve's batch-invariant kernel (`numerics.linear`: AMX tiles over weights packed
once, or bf16 lanes), oneDNN's inner product over weights packed for one row (wave 6's exact default), torch's
F.linear (not batch-invariant) and F.linear over the fp32 weights (the default where bf16 is not served) —
interleaved, median of `--reps`; beside them one read of the weight at the DRAM read bandwidth measured in the same
run (P6's floor: a buffer 4× the last-level cache).

    python benchmarks/projection_kernel.py [--threads 1 2] [--reps 7] [--out FILE]

`--layouts`: where the kernel packs weights (AVX512-BF16 lanes, AMX tiles), the same kernel over a weight as it
is (N, K) against its packed form — bf16 and int8, each weight cold (as many copies as fill `--cold-mb`, called
in turn), interleaved — the measurement behind the lanes form's packing (docs/benchmarks.md).

`--fused-rows`: the AVX512-BF16 form's calls of several rows over packed bf16 weights as fused multiply-adds against
VDPBF16PS (`kernels.set_fused_rows`), weights cached, the two ways alternating in this process — µs a call, G
multiply-adds a second, the same outputs checked (default rows 4 8 16 32 128).

`--step`: a decode step's projections at fla's 340M shapes — 24 layers of q/k/v/o (1,024 × 1,024), gate+up
(5,632 × 1,024) and down (1,024 × 2,816), 617 MB of packed bf16 (`--int8`: 308 MB of int8 with per-output scales),
past the cache as in the engine — at `--rows`
(default 1 2 4 8): ms a step, GB/s of weights read, G multiply-adds a second (median of `--reps`, on the largest of
`--threads`). `--streamed-rows 0 64`: those limits of `kernels.set_streamed_rows` (up to how many rows a call
streams each group with its first row alone; 0: every row blocked) alternating in this process, the same outputs
checked. Two trees side by side: each one's python on this script in turn.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import describe, emit  # noqa: E402
from decode_vs_context import bandwidths  # noqa: E402

from linserve.model import kernels, numerics  # noqa: E402

SHAPES = {  # (N, K): what the projection reads
    "shipped qkv": (768, 256), "shipped mlp up": (1024, 256), "shipped mlp down": (256, 1024),
    "shipped head": (4096, 256), "340M q/k/v/o": (1024, 1024), "340M mlp gate+up": (5632, 1024),
    "340M mlp down": (1024, 2816), "340M head (4,096 vocab)": (4096, 1024),
}


STEP_LAYERS = 24
STEP_SHAPES = [(1024, 1024)] * 4 + [(5632, 1024), (1024, 2816)]  # one 340M layer's projections: (N, K) each


def switch_streamed_rows(limit: int | None) -> None:
    if limit is not None:
        kernels.set_streamed_rows(limit)


def step_projections(args, result: dict) -> None:
    """A decode step's projections over 340M's shapes, packed once and streamed from memory, at each row count."""
    op = torch.ops.linserve
    generator = torch.Generator().manual_seed(0)
    torch.set_num_threads(max(args.threads))
    dtype = torch.int8 if args.int8 else torch.bfloat16
    weights = [(op.pack_weight(torch.randn(N, K, generator=generator).mul(40 if args.int8 else 1).clamp(-127, 127)
                               .to(dtype)), N, K)  # (N/16, K/32, 16, 32)
               for _ in range(STEP_LAYERS) for N, K in STEP_SHAPES]
    scales = {N: torch.rand(N, generator=generator) / 20 if args.int8 else None for N, _ in STEP_SHAPES}  # (N,)
    total = sum(N * K for _, N, K in weights)
    result["step"] = {"weight_bytes": dtype.itemsize * total, "dtype": str(dtype).split(".")[-1],
                      "threads": max(args.threads), "streamed_rows": kernels.streamed_rows()}
    limits = args.streamed_rows or [None]  # (None: the switch as the kernel set it)
    inputs = {M: {K: torch.randn(M, K, generator=generator).bfloat16() for K in {K for _, _, K in weights}}
              for M in args.rows}  # (M, K) each
    for M in args.rows:  # every way the same bits (each limit against the first)
        outputs = []
        for limit in limits:
            switch_streamed_rows(limit)
            outputs.append([op.invariant_linear(inputs[M][K], weight, scales[N], None, N)
                            for weight, N, K in weights[:6]])
        assert all(torch.equal(a, b) for other in outputs[1:] for a, b in zip(outputs[0], other)), M
    times: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.reps):  # the limits alternating, each M once a round
        for M in args.rows:
            for limit in limits:
                switch_streamed_rows(limit)
                started = time.perf_counter()
                for weight, N, K in weights:
                    op.invariant_linear(inputs[M][K], weight, scales[N], None, N)
                times.setdefault((M, limit), []).append(time.perf_counter() - started)
    switch_streamed_rows(limits[0])
    for M in args.rows:
        for limit in limits:
            seconds = statistics.median(times[(M, limit)])
            row = {"ms": round(seconds * 1e3, 2), "weights_gb_s": round(dtype.itemsize * total / seconds / 1e9, 1),
                   "g_mac_s": round(total * M / seconds / 1e9, 1)}
            result["step"][f"M={M}" if len(limits) == 1 else f"M={M} streamed_rows={limit}"] = row
            shown = kernels.streamed_rows() if limit is None else limit
            print(f"a step's 340M projections, M={M}, streamed rows {shown}: {row}", file=sys.stderr)


def per_call_us(call, calls: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


def layouts(args, result: dict) -> None:
    """The kernel over (N, K) weights against pack_weight's form, cold weights, interleaved (µs a call)."""
    op = torch.ops.linserve
    generator = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (N, K) in SHAPES.items():
            for dtype in (torch.bfloat16, torch.int8):
                copies = max(2, int(args.cold_mb * 2**20 // (N * K * dtype.itemsize)))
                plain = [torch.randn(N, K, generator=generator).mul(20).clamp(-127, 127).to(dtype)
                         for _ in range(copies)]  # (N, K) each
                packed = [op.pack_weight(weight) for weight in plain]
                scale = torch.rand(N, generator=generator) / 20 if dtype == torch.int8 else None  # (N,)
                bias = torch.randn(N, generator=generator).bfloat16()  # (N,)
                for M in args.rows:
                    x = torch.randn(M, K, generator=generator).bfloat16()  # (M, K)
                    times = {"n_k": [], "packed": []}
                    for _ in range(args.reps):
                        for form, weights in (("n_k", plain), ("packed", packed)):
                            started = time.perf_counter()
                            for weight in weights:
                                op.invariant_linear(x, weight, scale, bias, N)
                            times[form].append((time.perf_counter() - started) / copies * 1e6)
                    row = {form: round(statistics.median(values), 1) for form, values in times.items()}
                    row["speedup"] = round(row["n_k"] / row["packed"], 2)
                    same = torch.equal(op.invariant_linear(x, plain[0], scale, bias, N),
                                       op.invariant_linear(x, packed[0], scale, bias, N))
                    if not same and kernels.form() != "amx":  # (AMX tiles round their own way)
                        sys.exit(f"{name} M={M}: the packed form's outputs differ from the (N, K) form's")
                    key = f"{name} {str(dtype).split('.')[-1]} N={N} K={K} M={M} threads={threads}"
                    result["layouts"][key] = row
                    print(f"{key}: {row}", file=sys.stderr)
                del plain, packed


def fused_rows_against_vdpbf16ps(args, result: dict) -> None:
    """Each shape × rows with the fused rows on and off in turn (µs a call, median of `--reps` rounds)."""
    op = torch.ops.linserve
    generator = torch.Generator().manual_seed(0)
    torch.set_num_threads(max(args.threads))
    was = kernels.fused_rows()
    for name, (N, K) in SHAPES.items():
        weight = op.pack_weight(torch.randn(N, K, generator=generator).mul(0.05).bfloat16())  # (N/16, K/32, 16, 32)
        for M in args.rows:
            x = torch.randn(M, K, generator=generator).bfloat16()  # (M, K)
            calls = max(3, int(2e8 // (M * N * K)))
            call = functools.partial(op.invariant_linear, x, weight, None, None, N)
            times: dict[bool, list[float]] = {True: [], False: []}
            outputs = {}
            for rep in range(args.reps):  # alternating, each way first in turn
                for fused in (True, False) if rep % 2 == 0 else (False, True):
                    kernels.set_fused_rows(fused)
                    times[fused].append(per_call_us(call, calls))
                    outputs[fused] = call()
            if not torch.equal(outputs[True].view(torch.int16), outputs[False].view(torch.int16)):
                sys.exit(f"{name} M={M}: the fused rows' outputs differ from VDPBF16PS's")
            fused, plain = statistics.median(times[True]), statistics.median(times[False])
            row = {"fused_us": round(fused, 1), "vdpbf16ps_us": round(plain, 1), "speedup": round(plain / fused, 2),
                   "fused_g_mac_s": round(M * N * K / fused / 1e3, 1),
                   "vdpbf16ps_g_mac_s": round(M * N * K / plain / 1e3, 1)}
            result["fused_rows"][f"{name} N={N} K={K} M={M}"] = row
            print(f"{name:24} M={M:4}: {row}", file=sys.stderr)
    kernels.set_fused_rows(was)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", help="default 1 8 512 (--step: 1 2 4 8)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layouts", action="store_true", help="(N, K) weights against packed ones, cold")
    parser.add_argument("--cold-mb", type=float, default=400, help="--layouts: copies of each weight to fill this")
    parser.add_argument("--step", action="store_true", help="a decode step's 340M projections, streamed")
    parser.add_argument("--fused-rows", action="store_true", help="AVX512-BF16: fused rows against VDPBF16PS")
    parser.add_argument("--int8", action="store_true", help="--step: int8 weights with per-output scales")
    parser.add_argument("--streamed-rows", type=int, nargs="+",
                        help="--step: these limits of kernels.set_streamed_rows alternating (0: every row blocked)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.rows = args.rows or ([1, 2, 4, 8] if args.step else [4, 8, 16, 32, 128] if args.fused_rows else [1, 8, 512])
    if not kernels.load():
        sys.exit(f"the kernel is unavailable: {kernels.load_error()}")
    device = torch.device("cpu")
    result = {"machine": describe(device), "kernel_form": kernels.form(),
              "floor": bandwidths(device, 64 * 2**20, quick=False), "calls": {}, "layouts": {}}
    if args.fused_rows:
        if kernels.form() != "avx512bf16":
            sys.exit(f"the kernel's {kernels.form()} form has no fused rows to compare")
        result["fused_rows"] = {"threads": max(args.threads), "chosen_at_load": kernels.fused_rows()}
        fused_rows_against_vdpbf16ps(args, result)
        emit(result, args.out)
        return
    if args.step:
        step_projections(args, result)
        emit(result, args.out)
        return
    if args.layouts:
        if not kernels.PACKS_TILES:
            sys.exit(f"the kernel's {kernels.form()} form reads weights as they are: nothing to compare")
        layouts(args, result)
        emit(result, args.out)
        return
    dram = result["floor"]["dram_gb_s"]
    generator = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (N, K) in SHAPES.items():
            weight = torch.randn(N, K, generator=generator).bfloat16()  # (N, K)
            try:
                onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            except RuntimeError:  # (oneDNN's bf16 needs AVX512BW/VL/DQ or AVX-NE-CONVERT: an AVX2 CPU has neither)
                onednn = None
            weight_fp32 = weight.float()  # (N, K): what a CPU without bf16 served before the AVX2 lanes
            for M in args.rows:
                x = torch.randn(M, K, generator=generator).bfloat16()  # (M, K)
                calls = max(3, min(300, int(2e5 / (N * K * M) * 100)))
                forms = {"kernel": functools.partial(numerics.linear, x, weight),
                         "onednn_one_row": functools.partial(torch.ops.mkldnn._linear_pointwise, x, onednn, None,
                                                             "none", [], ""),
                         "f_linear": functools.partial(torch.nn.functional.linear, x, weight),
                         "f_linear_fp32": functools.partial(torch.nn.functional.linear, x.float(), weight_fp32)}
                if onednn is None:
                    del forms["onednn_one_row"]
                times = {form: [] for form in forms}
                for _ in range(args.reps):  # interleaved: drift falls on every form alike
                    for form, call in forms.items():
                        times[form].append(per_call_us(call, calls))
                row = {form: round(statistics.median(values), 1) for form, values in times.items()}
                row["weight_read_us"] = round(N * K * 2 / dram / 1e3, 1)
                row["kernel_vs_floor"] = round(row["kernel"] / row["weight_read_us"], 2)
                if onednn is not None:
                    row["kernel_vs_onednn"] = round(row["onednn_one_row"] / row["kernel"], 2)
                row["kernel_vs_fp32"] = round(row["f_linear_fp32"] / row["kernel"], 2)
                result["calls"][f"{name} N={N} K={K} M={M} threads={threads}"] = row
                print(f"{name:24} M={M:4} t={threads}: {row}", file=sys.stderr)
    emit(result, args.out)


if __name__ == "__main__":
    main()
