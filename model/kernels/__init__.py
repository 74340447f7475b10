"""linserve's own CPU kernels, built from source on first use and cached (like the compiled programs).

`delta_rule.cpp` holds T tokens of the (gated) delta rule and of the gated linear recurrence in one call, each
(row, head)'s state carried across the tokens in the cache (`torch.ops.linserve.delta_scan`: DeltaNet's and Gated
DeltaNet's prefill and verification; `linear_scan`: the shipped model's and the gated linear families' prefill,
decoding and verification), and one token of RWKV-7's generalised delta rule for every row and head in one pass
over the state (`dplr_step`) — their scans' arithmetic exactly.
`pooled_state.cpp` holds the decode step's recurrences on the state pool itself, in two passes (`linear_read` /
`delta_read` from each row's slot, then `state_commit` in place once the step's rows are known good; the delta rule's
`linear_read_folded` and `delta_read_folded` apply the slot's pending update as they read, and `pending_record` notes
the next one; `pending_settle` writes the pending updates of listed slots, every folded state in one call).
`sampling.cpp` holds the decode program's sampling (`torch.ops.linserve.choose_tokens`: one pass a row for its
penalties, its counter-based uniform and its draw — server/engine/sampling.py's `choose_tokens`, to the bit; the
draw alone, `tempered_draw`, in what torch did in a division, exponentials over the whole vocabulary, two `topk`
calls, a tie mask and a window) and the verification program's acceptance (`verify_choose`: each position of a row
chosen as a decode step would choose it, its drafts' counts added as it goes, stopping at the first refused draft).
`invariant_linear.cpp` holds the batch-invariant projection (`torch.ops.linserve.invariant_linear`, and
`invariant_linear_cat` for up to four weights over one input in one parallel region): each output a fixed sequence
of roundings whatever the number of rows, bf16 or int8 weights packed once (on memory advised as huge pages) or in
the checkpoint's own (N, K) layout: AMX tiles or AVX512-BF16 lanes where the CPU has them, the same lanes'
arithmetic in plain AVX512 instructions on an AVX512 CPU without bf16 arithmetic, in AVX2 halves on an AVX2 CPU
(AVX2 + FMA: AMD Zen 2/3, Intel Haswell on), in scalar code elsewhere (or a
lower form than the CPU's, named by LINSERVE_KERNEL_ISA: `kernel_isa`). It is
built once per (source, torch, form) with the C++ compiler Inductor uses into
`$XDG_CACHE_HOME/linserve/kernels/<key>/` (else `~/.cache/…`; `LINSERVE_KERNEL_DIR` overrides), loaded into the
process with its symbols global — a compiled program's C++ calls the op's C shim
(`aoti_torch_cpu_invariant_linear`) by name — and its op registered with a shape function so that torch.export
traces it as one call. `program_call.cpp` calls a compiled program with its tensors' handles made in C++ (and
`use_work_pool` switches the calling thread's kernel regions onto the kernels' own threads, `work_pool.h`: a region
that waits only for the threads that joined it), and `cpu_allocator.cpp` is a caching CPU allocator for torch's
tensors, installed at load (`use_caching_allocator`;
LINSERVE_CPU_ALLOCATOR=default keeps torch's own). Without a C++ compiler (a slim image), or with
`LINSERVE_KERNELS=off` in the environment, `load()` says why and returns False: the model then keeps oneDNN's
inner product (numerics.linear).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import threading

import torch

from .fake_ops import register_fake_ops

logger = logging.getLogger(__name__)

SOURCES = [os.path.join(os.path.dirname(__file__), name) for name in ("invariant_linear.cpp", "delta_rule.cpp",
                                                                           "pooled_state.cpp", "sampling.cpp",
                                                                           "program_call.cpp", "cpu_allocator.cpp")]
# every header beside the sources, part of the build's key (listed from the directory: a new one needs no entry here)
HEADERS = sorted(os.path.join(os.path.dirname(__file__), name) for name in os.listdir(os.path.dirname(__file__))
                 if name.endswith(".h"))
LIBRARY = "liblinserve_kernels.so"
C_SHIMS = {  # op → the C function a compiled program calls (defined in the sources)
    "invariant_linear": "AOTITorchError aoti_torch_cpu_invariant_linear(AtenTensorHandle x, AtenTensorHandle weight, "
                        "AtenTensorHandle* scale, AtenTensorHandle* bias, int64_t out_features, "
                        "AtenTensorHandle* ret0)",
    "invariant_linear_cat": "AOTITorchError aoti_torch_cpu_invariant_linear_cat(AtenTensorHandle x, "
                            "AtenTensorHandle w0, AtenTensorHandle w1, AtenTensorHandle* w2, AtenTensorHandle* w3, "
                            "AtenTensorHandle* s0, AtenTensorHandle* s1, AtenTensorHandle* s2, AtenTensorHandle* s3, "
                            "int64_t n0, int64_t n1, int64_t n2, int64_t n3, AtenTensorHandle* ret0)",
    "linear_scan": "AOTITorchError aoti_torch_cpu_linear_scan(AtenTensorHandle q, AtenTensorHandle k, "
                   "AtenTensorHandle v, AtenTensorHandle* alpha, AtenTensorHandle S, int32_t prefixes, "
                   "AtenTensorHandle* ret0, AtenTensorHandle* ret1)",
    "delta_scan": "AOTITorchError aoti_torch_cpu_delta_scan(AtenTensorHandle q, AtenTensorHandle k, "
                  "AtenTensorHandle v, AtenTensorHandle beta, AtenTensorHandle* alpha, AtenTensorHandle S, "
                  "int32_t prefixes, AtenTensorHandle* ret0, AtenTensorHandle* ret1)",
    "dplr_step": "AOTITorchError aoti_torch_cpu_dplr_step(AtenTensorHandle r, AtenTensorHandle d, AtenTensorHandle k, "
                 "AtenTensorHandle v, AtenTensorHandle a, AtenTensorHandle b, AtenTensorHandle S, "
                 "AtenTensorHandle* ret0, AtenTensorHandle* ret1)",
    "linear_read": "AOTITorchError aoti_torch_cpu_linear_read(AtenTensorHandle q, AtenTensorHandle k, "
                   "AtenTensorHandle v, AtenTensorHandle* alpha, AtenTensorHandle pool, AtenTensorHandle slots, "
                   "AtenTensorHandle* ret0)",
    "delta_read": "AOTITorchError aoti_torch_cpu_delta_read(AtenTensorHandle q, AtenTensorHandle k, "
                  "AtenTensorHandle v, AtenTensorHandle beta, AtenTensorHandle* alpha, AtenTensorHandle pool, "
                  "AtenTensorHandle slots, AtenTensorHandle* ret0, AtenTensorHandle* ret1)",
    "delta_read_folded": "AOTITorchError aoti_torch_cpu_delta_read_folded(AtenTensorHandle q, AtenTensorHandle k, "
                         "AtenTensorHandle v, AtenTensorHandle beta, AtenTensorHandle* alpha, AtenTensorHandle pool, "
                         "AtenTensorHandle slots, AtenTensorHandle pk, AtenTensorHandle pu, AtenTensorHandle pa, "
                         "AtenTensorHandle flag, AtenTensorHandle* ret0, AtenTensorHandle* ret1)",
    "linear_read_folded": "AOTITorchError aoti_torch_cpu_linear_read_folded(AtenTensorHandle q, AtenTensorHandle k, "
                          "AtenTensorHandle v, AtenTensorHandle* alpha, AtenTensorHandle pool, AtenTensorHandle slots, "
                          "AtenTensorHandle pk, AtenTensorHandle pu, AtenTensorHandle pa, AtenTensorHandle flag, "
                          "AtenTensorHandle* ret0)",
    "pending_record": "AOTITorchError aoti_torch_cpu_pending_record(AtenTensorHandle pk, AtenTensorHandle pu, "
                      "AtenTensorHandle pa, AtenTensorHandle flag, AtenTensorHandle slots, AtenTensorHandle k, "
                      "AtenTensorHandle u, AtenTensorHandle* alpha, AtenTensorHandle keep, AtenTensorHandle* ret0)",
    "state_commit": "AOTITorchError aoti_torch_cpu_state_commit(AtenTensorHandle pool, AtenTensorHandle slots, "
                    "AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle* alpha, AtenTensorHandle keep, "
                    "AtenTensorHandle* ret0)",
    "choose_tokens": "AOTITorchError aoti_torch_cpu_choose_tokens(AtenTensorHandle logits, AtenTensorHandle slots, "
                     "AtenTensorHandle positions, AtenTensorHandle floats, AtenTensorHandle top_k, "
                     "AtenTensorHandle seed, AtenTensorHandle bias, AtenTensorHandle counts, AtenTensorHandle seen, "
                     "AtenTensorHandle* ret0, AtenTensorHandle* ret1, AtenTensorHandle* ret2, "
                     "AtenTensorHandle* ret3, AtenTensorHandle* ret4)",
    "verify_choose": "AOTITorchError aoti_torch_cpu_verify_choose(AtenTensorHandle logits, AtenTensorHandle ids, "
                     "AtenTensorHandle limits, AtenTensorHandle slots, AtenTensorHandle positions, "
                     "AtenTensorHandle floats, AtenTensorHandle seed, AtenTensorHandle bias, AtenTensorHandle counts, "
                     "AtenTensorHandle seen, AtenTensorHandle* ret0, AtenTensorHandle* ret1, AtenTensorHandle* ret2, "
                     "AtenTensorHandle* ret3, AtenTensorHandle* ret4, AtenTensorHandle* ret5)",
}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "library": the loaded CDLL, or "error": why there is none


ISAS = ("scalar", "avx2", "avx512", "avx512bf16", "amx")  # the kernel's forms, each needing what the one before needs
ISA_VARIABLE = "LINSERVE_KERNEL_ISA"


def kernel_isa() -> str:
    """The form the kernel is built in: the CPU's (`cpu_isa`), or a lower one named by LINSERVE_KERNEL_ISA — one
    form for a fleet of different CPUs (the lanes forms give the scalar code's bits on every vendor's CPU; AMX's
    tiles, and AMD's VDPBF16PS in one corner of subnormal products, do not), and the plain forms tested on a CPU
    that has more. A form above the CPU's is the CPU's (logged); a name that is no form is a ValueError."""
    found = cpu_isa()
    asked = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if not asked:
        return found
    if asked not in ISAS:
        raise ValueError(f"{ISA_VARIABLE}={asked!r}: must be one of {', '.join(ISAS)} (or unset: this CPU's best, "
                         f"{found})")
    if ISAS.index(asked) > ISAS.index(found):
        if not _state.get("isa_warned"):
            _state["isa_warned"] = True
            logger.warning("%s=%s: this CPU runs at most the %s form", ISA_VARIABLE, asked, found)
        return found
    return asked


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's flags as Linux names them (empty where /proc/cpuinfo is not)."""
    try:
        with open(cpuinfo) as info:
            return set(next((line for line in info if line.startswith("flags")), "").split())
    except OSError:
        return set()


FP16_FLAG = "-mavx512fp16"


def fp16_widening(isa: str, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the bf16 lanes widen int8 weights through AVX512-FP16 (Sapphire Rapids on: one int8 row over cached
    weights 1.2-1.8x faster; the same bf16 values, so the same bits): where the kernel is built in the CPU's own
    AVX512-BF16 or AMX form and the CPU has it — not in a form named for a fleet (LINSERVE_KERNEL_ISA), whose other
    CPUs may not."""
    return (isa in ("avx512bf16", "amx") and not os.environ.get(ISA_VARIABLE, "").strip()
            and platform.machine() == "x86_64" and "avx512_fp16" in cpu_flags(cpuinfo))


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The best kernel form this CPU can run: "amx" (AMX-BF16 tiles), "avx512bf16" (bf16 dot products in vector
    registers), "avx512" (AVX512 without bf16 arithmetic: the same lanes in plain vector instructions), "avx2"
    (AVX2 + FMA without AVX512: the same lanes as two 8-float halves) or
    "scalar" — from Linux's CPU flags (elsewhere: scalar)."""
    flags = cpu_flags(cpuinfo)
    if platform.machine() != "x86_64" or not {"avx2", "fma"} <= flags:
        return "scalar"
    if not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx2"
    if "avx512_bf16" not in flags:
        return "avx512"
    return "amx" if {"amx_tile", "amx_bf16"} <= flags else "avx512bf16"


def compiler() -> str | None:
    """The C++ compiler: $CXX, else g++, c++ or clang++ on PATH (Inductor's own choice); None in a slim image."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def user_cache(name: str) -> str:
    """linserve's cache directory `name` for this user: `$XDG_CACHE_HOME/linserve/NAME`, else `~/.cache/…`."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "linserve", name)


def cache_dir() -> str:
    return os.environ.get("LINSERVE_KERNEL_DIR") or user_cache("kernels")


def build_command(cxx: str, source: str, output: str, isa: str) -> list[str]:
    """The compiler's command for one translation unit, `source`: a file that includes every one of SOURCES (a unity
    build — torch's headers, most of the time a kernel source takes to compile, are parsed once: ~30 s instead of
    ~90 on 2 cores). So the sources' names at file scope must differ (each has its own anonymous namespace)."""
    from torch.utils import cpp_extension

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    avx512 = ["-DLINSERVE_LANES", "-mavx512f", "-mavx512bw", "-mavx512vl"]
    flags = {"scalar": [], "avx2": ["-DLINSERVE_AVX2", "-mavx2", "-mfma"], "avx512": avx512,
             "avx512bf16": [*avx512, "-DLINSERVE_AVX512BF16", "-mavx512bf16"]}
    flags["amx"] = [*flags["avx512bf16"], "-DLINSERVE_AMX", "-mamx-tile", "-mamx-bf16"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    widening = [FP16_FLAG] if fp16_widening(isa) else []  # (linear_lanes.h: load_w of int8)
    return [cxx, "-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", abi, *flags[isa], *widening,
            *includes,
            f"-I{sysconfig.get_paths()['include']}", source, "-o", output, f"-L{torch_lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{torch_lib}"]


def library_path() -> tuple[str, str]:
    """Where this source, torch and kernel form's build lives, and its instruction set (`kernel_isa`)."""
    isa = kernel_isa()
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        with open(path, "rb") as source:
            digest.update(source.read())
    # the sources' names and the command, not their paths: another checkout of the same source (a baseline through a
    # namespace shim, a worktree) shares the build; the contents above tell sources apart
    command = build_command("c++", "kernels.cpp", "out", isa)
    digest.update(" ".join([*map(os.path.basename, SOURCES), *command]).encode())
    key = f"{digest.hexdigest()[:16]}-torch{torch.__version__}-{platform.machine()}-{isa}"
    return os.path.join(cache_dir(), key.replace("/", "_"), LIBRARY), isa


def build(path: str, isa: str) -> None:
    """Compile into `path` once: under a lock on its directory (another process may be building it), by rename."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (g++ or c++ on PATH, or $CXX)")
        temp = f"{path}.{os.getpid()}.tmp"
        unit = f"{temp}.cpp"
        with open(unit, "w") as sources:
            sources.writelines(f'#include "{source}"\n' for source in SOURCES)
        try:
            command = build_command(cxx, unit, temp, isa)
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0 and FP16_FLAG in command:  # a compiler older than AVX512-FP16 (GCC < 12):
                logger.warning("the kernel's build with %s failed; int8 widens through fp32 instead", FP16_FLAG)
                result = subprocess.run([flag for flag in command if flag != FP16_FLAG], capture_output=True,
                                        text=True)  # (the same bits, the slower widening)
        finally:
            os.unlink(unit)
        if result.returncode != 0:
            raise RuntimeError(f"building linserve's kernels failed: {result.stderr[-2000:]}")
        os.replace(temp, path)


def load() -> bool:
    """Build (first use) and load the kernels into this process; False, with the reason logged once, when they
    cannot be — the caller then uses torch's own kernels."""
    if "library" in _state:  # (every projection asks: no lock once loaded)
        return True
    with _lock:
        if "library" in _state:
            return True
        if "error" in _state:
            return False
        if os.environ.get("LINSERVE_KERNELS", "on").lower() == "off":  # an operator's escape hatch (and A/B runs)
            _state["error"] = "turned off by LINSERVE_KERNELS=off"
            logger.info("linserve's projection kernel is off (LINSERVE_KERNELS=off): oneDNN's inner product")
            return False
        try:
            path, isa = library_path()
            if not os.path.exists(path):
                build(path, isa)
            library = _state["library"] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # global: programs call its shim
            caching = os.environ.get("LINSERVE_CPU_ALLOCATOR", "caching").lower() != "default"
            library.linserve_cpu_allocator(int(caching))  # (use_caching_allocator, without load()'s lock again)
            global PACKS_TILES
            PACKS_TILES = form() != "scalar"  # AMX tiles or the vector lanes' groups
            register_fake_ops(PACKS_TILES)
            logger.info("linserve kernels loaded from %s (%s%s%s)", path, form(),
                        ", int8 widened through fp16" if library.linserve_int8_through_fp16() else "",
                        ", rows fused" if library.linserve_fused_rows() else "")
            return True
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _state["error"] = str(error)
            logger.warning("linserve's batch-invariant projection kernel is unavailable (%s): projections use "
                           "oneDNN's inner product", error)
            return False


def use_caching_allocator(caching: bool = True) -> bool:
    """torch's CPU tensors from now on from the kernels' caching allocator (cpu_allocator.cpp: freed blocks of up to
    1 MB kept by size class, 64 MB at most) or, `caching=False`, from torch's own; whether the caching one was in
    force before. Done at `load()` unless LINSERVE_CPU_ALLOCATOR=default; without the kernels, nothing (False)."""
    if not load():
        return False
    return bool(_state["library"].linserve_cpu_allocator(int(caching)))


def cached_allocator_bytes() -> int:
    """The bytes the caching allocator holds in freed blocks (0 when nothing is cached or it never ran)."""
    return _int64_answer("linserve_cpu_allocator_cached_bytes")


def _int64_answer(function: str, *arguments: int) -> int:
    """What the loaded library's int64_t `function(int64_t…)` returns; 0 when the kernels are not loaded."""
    library = _state.get("library")
    if not library:
        return 0
    answer = getattr(library, function)
    answer.restype, answer.argtypes = ctypes.c_int64, [ctypes.c_int64] * len(arguments)
    return answer(*arguments)


def load_error() -> str | None:
    return _state.get("error")  # type: ignore[return-value]


FORMS = {2: "amx", 1: "avx512bf16", 3: "avx512", 4: "avx2", 0: "scalar"}
LANES_FORMS = ("avx512bf16", "avx512", "avx2")  # the lanes over packed weights in vector registers
# set at load: the kernel reads weights packed by `pack_weight` (a new tensor: AMX tiles, or the lanes form's groups
# of 16 outputs side by side) wherever the CPU has AVX512 (with AVX512-BF16 or without); the scalar form reads a
# weight as it is (N, K) and nothing is packed — a plain module constant, so a compiler tracing a projection reads it
# as one (an op that returned its own input would alias it, which torch's custom-op checks refuse)
PACKS_TILES = False


def form() -> str | None:
    """Which form the loaded kernel runs: "amx" (tiles over packed weights), "avx512bf16" or "avx512" (lanes over
    packed weights) or "scalar" (lanes over the (N, K) weights) — the three lanes forms the same bits; None when not
    loaded."""
    library = _state.get("library")
    return FORMS[library.linserve_kernel_form()] if library else None


def streamed_rows() -> int:
    """Up to how many rows a lanes-form call over packed bf16 weights now streams each group with its first row alone
    (the other rows then read the group from the cache): 64 (`set_streamed_rows`) while the process's packed weights
    of a megabyte or more exceed one L3 cache (a decode step streams them from DRAM), else 0 (invariant_linear.cpp,
    `rows_avx512`); the AVX2 form 1 then (a one-row call's single pass over each group, `avx2_row_streamed`; several
    rows blocked alike). Which way a call goes changes no bit of its outputs."""
    library = _state.get("library")
    return library.linserve_streamed_rows() if library else 0


def set_streamed_rows(rows: int) -> int:
    """Set up to how many rows a call over streamed packed bf16 weights streams each group with its first row alone
    (0: none — every row in the blocked passes); what it was. Tests and A/B runs: no bit changes either way."""
    return _int64_answer("linserve_set_streamed_rows", rows)


def fused_rows() -> bool:
    """Whether calls of several rows over packed bf16 weights run as fused multiply-adds rather than VDPBF16PS
    (the AVX512-BF16 form, where that measured faster at load or LINSERVE_FUSED_ROWS=on; linear_lanes.h,
    `fused_quad`): the same bits either way (every product in range, checked per call)."""
    library = _state.get("library")
    return bool(library.linserve_fused_rows()) if library else False


def set_fused_rows(on: bool) -> bool:
    """Turn the fused rows on or off in this process (tests, A/B runs); what it was. Only the AVX512-BF16 form has
    them: elsewhere nothing changes (False)."""
    library = _state.get("library")
    return bool(library.linserve_set_fused_rows(int(on))) if library else False


def last_level_cache_bytes() -> int:
    """One L3 instance's bytes, as the kernel reads them (0 when not loaded)."""
    return _int64_answer("linserve_last_level_cache_bytes")


def inductor_configs() -> dict:
    """What an AOTInductor build needs to call the op's C shim directly (no proxy executor, no dispatcher)."""
    if "library" not in _state:
        return {}
    return {"aot_inductor.custom_ops_to_c_shims": {getattr(torch.ops.linserve, name).default: [shim]
                                                   for name, shim in C_SHIMS.items()}}
