"""A compiled CPU bucket called without holding the GIL.

torch's own loader (`torch._inductor.aoti_load_package`) runs an AOTInductor program while holding the GIL:
for the ~0.6 ms of a batch-1 step, no other Python thread of the server can run — the event loop writing the
previous token's SSE event included — so HTTP work and the program take turns instead of overlapping (a pure
Python thread beside the program advanced at 3% of its idle rate; measured in docs/engine.md, "Threads").

The artifact is a zip holding one shared library with the program and its weights, whose C entry points are
AOTInductor's stable ABI (`AOTInductorModelContainerCreateWithDevice`, `…Run`, `…Delete`). Called through
ctypes, the call releases the GIL for its whole length; tensors cross as AtenTensorHandles made and taken by
torch's own helpers (`torch._C._aoti`), exactly as its loader passes them — or, where linserve's kernels are loaded,
made and taken in C++ by `torch.ops.linserve.run_program` (model/kernels/program_call.cpp: a step passes ~40 tensors,
the weights among them, and one ctypes call per handle cost ~40 µs of a ~0.8 ms one-row step; torch.ops releases the
GIL for the call as ctypes does). Anything unexpected — no such
entry point, a failed create — falls back to torch's loader (logged), so a torch that changes this ABI serves
as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import zipfile

import torch

from linserve.model import kernels

logger = logging.getLogger(__name__)

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype, _new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def open_library(package: str) -> ctypes.CDLL:
    """The package's shared library, loaded: written to a temporary file beside the package, opened, and
    unlinked at once (the mapping stays; nothing is left on disk — as torch's loader extracts on every load)."""
    with zipfile.ZipFile(package) as archive:
        (member,) = [name for name in archive.namelist() if name.endswith(".so")]
        temp = f"{os.path.splitext(package)[0]}.{os.getpid()}.{threading.get_ident()}.so"
        try:
            with archive.open(member) as source, open(temp, "wb") as out:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            return ctypes.CDLL(temp)  # CDLL, not PyDLL: its calls release the GIL
        finally:
            if os.path.exists(temp):
                os.unlink(temp)


class ReleasingProgram:
    """`program(*tensors) -> list of tensors`, like torch's loaded package, with the GIL released."""

    def __init__(self, package: str) -> None:
        self.library = open_library(package)
        self.handle = ctypes.c_void_p()
        self._delete = self.library.AOTInductorModelContainerDelete
        self._run = self.library.AOTInductorModelContainerRun
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_void_p, ctypes.c_void_p]
        check(self.library.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self.handle), ctypes.c_size_t(1),
                                                                      b"cpu", None), "create")
        count = ctypes.c_size_t()
        check(self.library.AOTInductorModelContainerGetNumOutputs(self.handle, ctypes.byref(count)), "outputs")
        self.num_outputs = count.value
        self._in_cpp = None  # linserve's op (the C++ helper), when its kernels are loaded
        if kernels.load() and hasattr(torch.ops.linserve, "run_program"):
            self._in_cpp = torch.ops.linserve.run_program.default
            self._run_address = ctypes.cast(self._run, ctypes.c_void_p).value

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        if self._in_cpp is not None:
            return self._in_cpp(self._run_address, self.handle.value, inputs, self.num_outputs)
        handles = [_capsule_pointer(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)]
        in_array = (ctypes.c_void_p * len(handles))(*handles)  # the handles are the callee's to free
        out_array = (ctypes.c_void_p * self.num_outputs)()
        check(self._run(self.handle, in_array, len(handles), out_array, self.num_outputs, None, None), "run")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_new_capsule(out_array[i], None, None) for i in range(self.num_outputs)])

    def bind(self, tail: tuple[torch.Tensor, ...]) -> BoundProgram | None:
        """This program with its trailing inputs bound (None without linserve's kernels): see BoundProgram."""
        return BoundProgram(self, tail) if self._in_cpp is not None else None

    def __del__(self) -> None:
        if getattr(self, "handle", None) and self.handle.value:
            self._delete(self.handle)
            self.handle.value = None  # (no module global: at interpreter exit `ctypes` may already be gone)


class BoundProgram:
    """`bound(*leading) -> list of tensors`: a ReleasingProgram whose trailing inputs — the tensors a step passes
    the same on every call (the pool's buffers, the sampling tables, the weights: ~75 of a decode step's ~77) — are
    held in C++ (`linserve::bind_program`), so a call passes only its leading ones: no list of every input boxed
    and checked by the dispatcher on each step (model/kernels/program_call.cpp). The tensors are the binding's
    until it goes; the program is kept alive with it."""

    def __init__(self, program: ReleasingProgram, tail: tuple[torch.Tensor, ...]) -> None:
        self.program = program  # (its container outlives the binding)
        self.binding = torch.ops.linserve.bind_program(program._run_address, program.handle.value, list(tail),
                                                       program.num_outputs)
        self._run = torch.ops.linserve.run_bound.default
        self._run_rows = torch.ops.linserve.run_bound_rows.default
        self._unbind = torch.ops.linserve.unbind_program.default

    def __call__(self, *leading: torch.Tensor) -> list[torch.Tensor]:
        return self._run(self.binding, leading)

    def rows(self, io: list[int], rows: int, spans: tuple[int, ...]) -> list[torch.Tensor]:
        """The program with its leading inputs made in C++ from the io rows' values (`io`: rows × width, flat);
        `spans`: (start, count) a leading input — count 0: row `start` alone, (width,); else count rows."""
        return self._run_rows(self.binding, io, rows, spans)

    def __del__(self) -> None:
        if getattr(self, "binding", None) is not None:
            try:
                self._unbind(self.binding)
            except (RuntimeError, TypeError, AttributeError):  # (at interpreter exit torch may already be gone)
                pass
            self.binding = None


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"AOTInductor container {what} failed (status {status}; its message is on stderr)")


def allow_amx() -> None:
    """Ask Linux for the AMX tile state (x86 with AMX; a no-op elsewhere). A process must ask before its first
    tile instruction (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); oneDNN asks for itself, but an artifact's AMX GEMM
    kernels (max-autotune's templates) assume the process has: a server whose first bf16 GEMM was an
    autotuned bucket's died of SIGILL at its first `tilezero`."""
    init = getattr(torch._C._cpu, "_init_amx", None)
    if init is not None:
        init()


def load_program(package: str):
    """The package's program called without the GIL; torch's loader where that cannot be done. linserve's kernels
    are loaded first: a CPU program calls their C shims by name (every one draws through `tempered_draw`)."""
    kernels.load()
    allow_amx()
    try:
        return ReleasingProgram(package)
    except (OSError, AttributeError, ValueError, RuntimeError) as error:
        logger.warning("calling %s through torch's loader (holds the GIL while it runs): %s", package, error)
        return torch._inductor.aoti_load_package(package)
