"""Where compiled decode programs live, and how the CPU ones are obtained.

The compile cache has one directory per model, program source, build kind, dtype, torch version and device;
on CPU each batch bucket is an AOTInductor artifact there, loaded if present, else built by a compiler child
process (program_compiler.py). compiled_decode.DecodeStep decides which buckets to get and when.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading

import torch

from linserve.model import kernels, projection
from linserve.model.interface import ServedModel
from linserve.model.weights import content_digest

from .program_compiler import ARTIFACT_FORMAT, CPU, CompilerProcess, artifact_path, load_artifact, write_model

logger = logging.getLogger(__name__)

IN_USE = "in_use.lock"  # each process serving from a cache directory holds a shared flock on it for its life
_claims: dict[str, object] = {}  # directory → the open lock file this process holds


def compile_cache_dir(base: str | None, model: ServedModel, device: torch.device, autotune: bool = True,
                      sources: tuple[str, ...] = ()) -> str:
    """Where this model's compiled buckets live: under `base` (unset: the user's cache directory,
    `$XDG_CACHE_HOME/linserve/compile`, else `~/.cache/linserve/compile`), one subdirectory per model
    (config and weights: frozen weights are compiled in), the program's source code, how it is built
    (autotuned or not), dtype, torch version and device (GPU name; CPU architecture, vector instruction set
    and intra-op threads) — so every working directory shares one cache, and nothing compiled for another
    model, program version, machine or thread count is ever reused."""
    import platform

    if base is None:
        base = kernels.user_cache("compile")
    digest = content_digest(model)  # (the config and every weight)
    digest.update(f"artifact format {ARTIFACT_FORMAT}, autotune {autotune}".encode())
    for path in program_sources(sources):
        with open(path, "rb") as source:
            digest.update(source.read())
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:  # the CPU's vector instructions (an AVX-512 build must never load on an AVX2 host), as ATen detects
        # them at run time — not Inductor's pick_vec_isa, which test-compiles with g++: a slim image has none —
        # and the intra-op thread count, which Inductor's GEMM templates bake in (`num_threads = 2`)
        capability = torch.backends.cpu.get_cpu_capability().lower()
        # which kernel the programs call, over which weights
        projections = f"{kernels.form()}-{projection.weight_format()}" if kernels.load() else "onednn"
        where = f"cpu-{platform.machine()}-{capability}-threads{torch.get_num_threads()}-{projections}"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    key = f"{digest.hexdigest()[:16]}-{dtype}-torch{torch.__version__}-{where}".replace(" ", "_").replace("/", "_")
    return os.path.join(base, key)


def claim(directory: str) -> None:
    """This process uses `directory` (until it exits): `prune` never removes it. A shared flock on its lock file,
    held for the process's life (released by the kernel however the process ends), and its mtime is the
    directory's last use. A cache that cannot be written or locked (read-only, a file system without locks) is
    said in the log and left as it is: nothing here stops a server from starting."""
    if directory in _claims:
        return
    path = os.path.join(directory, IN_USE)
    try:
        while True:
            os.makedirs(directory, exist_ok=True)
            handle = open(path, "a+")  # noqa: SIM115 - held open on purpose, for the process's life
            fcntl.flock(handle, fcntl.LOCK_SH)
            try:
                if os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            handle.close()  # another process's prune removed the directory while this one waited: again
        os.utime(path)
    except OSError as error:
        logger.warning("compile cache: cannot mark %s as in use (%s); a prune elsewhere may remove it", directory,
                       error)
        return
    _claims[directory] = handle


def prune(base: str, max_bytes: int) -> list[str]:
    """Remove the least recently used model directories under `base` until it holds at most `max_bytes` —
    never one that a live process has claimed (this one's included). Returns the directories removed."""
    entries = []
    try:
        names = os.listdir(base)
    except OSError:  # (no cache yet, or not readable: nothing to prune)
        names = []
    for name in names:
        path = os.path.join(base, name)
        lock = os.path.join(path, IN_USE)
        try:
            if os.path.isdir(path):
                used = os.path.getmtime(lock if os.path.exists(lock) else path)
                entries.append((used, path, directory_bytes(path)))
        except OSError:  # removed meanwhile (another process's prune)
            continue
    total, removed = sum(size for _, _, size in entries), []
    for _, path, size in sorted(entries):  # least recently used first
        if total <= max_bytes:
            break
        if path not in _claims and _remove_unclaimed(path):
            total -= size
            removed.append(path)
    if removed:
        logger.info("compile cache over its %.1f GB: removed %d least recently used model director%s (%s); "
                    "%.1f GB left in %s", max_bytes / 1e9, len(removed), "y" if len(removed) == 1 else "ies",
                    ", ".join(os.path.basename(path) for path in removed), total / 1e9, base)
    return removed


def _remove_unclaimed(path: str) -> bool:
    """Remove `path` if no process holds it (an exclusive flock on its lock file, held while it is removed)."""
    try:
        handle = open(os.path.join(path, IN_USE), "a+")  # noqa: SIM115 - closed below
    except OSError:
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a live process serves from it
        handle.close()
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        handle.close()


def directory_bytes(path: str) -> int:
    """Bytes a directory tree occupies on disk."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def program_sources(extra: tuple[str, ...] = ()) -> list[str]:
    """The files whose code a compiled program contains: the model package and the program's own modules,
    plus `extra` (paths in the engine package) for a kind that has more (how it is built is
    program_compiler.ARTIFACT_FORMAT's business)."""
    import linserve.model as model_package

    model_dir = os.path.dirname(os.path.abspath(model_package.__file__))
    engine = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = ["decode_program.py", "sampling.py", "prefill_program.py", os.path.join("spec", "verify_program.py"),
           "state_pool.py", *extra]  # (state_pool.py: the buffers and pending updates, in the order programs take them)
    return sorted(os.path.join(directory, name) for directory in (model_dir, os.path.join(model_dir, "families"),
                                                                  os.path.join(model_dir, "kernels"))
                  for name in os.listdir(directory) if name.endswith((".py", ".cpp", ".h"))) + [
        os.path.join(engine, name) for name in own]


def cpp_compiler_available() -> bool:
    """Inductor builds its CPU kernels with a C++ compiler ($CXX, else g++): a slim image may have none."""
    return kernels.compiler() is not None


class ChildBuilder:
    """Each bucket's program is an AOTInductor artifact for `device` in the cache directory — loaded if
    there, else built by a compiler child process (started on the first miss; see program_compiler)."""

    def __init__(self, directory: str, model: ServedModel, num_slots: int, can_compile: bool, autotune: bool,
                 program: str = "decode", device: torch.device = CPU, threads: int | None = None) -> None:
        """`threads`: the intra-op count the programs are built for (CompilerProcess: default this thread's)."""
        self.directory, self.num_slots, self.can_compile, self.child = directory, num_slots, can_compile, None
        self.autotune, self.program, self.device, self.threads = autotune, program, device, threads
        self.model = model  # (a CPU program reads its packed projection weights as inputs: this model's)
        self._lock, self._closed = threading.Lock(), False  # (close() may come from another thread mid-call)
        write_model(directory, model)

    def cached(self, size: int) -> bool:
        """Whether the bucket's program is in the cache (loaded in milliseconds, not compiled)."""
        return os.path.exists(artifact_path(self.directory, self.num_slots, size, self.program))

    def __call__(self, size: int):
        """The bucket's program; None when it is not in the cache and this builder may not compile."""
        program = load_artifact(self.directory, self.num_slots, size, self.program, self.device, self.model)
        if program is None and self.can_compile:
            with self._lock:  # never a child started after close(): nothing would end it
                if self._closed:
                    raise RuntimeError("the compiler was closed")
                if self.child is None:
                    self.child = CompilerProcess(self.directory, self.num_slots, self.autotune, self.program,
                                                 self.device, self.threads)
                child = self.child
            child.compile(size)
            program = load_artifact(self.directory, self.num_slots, size, self.program, self.device, self.model)
        return program

    def close(self, final: bool = False) -> None:
        """End the compiler child (if any); a later miss starts another — unless `final`: then it raises."""
        with self._lock:
            child, self.child, self._closed = self.child, None, self._closed or final
        if child is not None:
            child.close()
