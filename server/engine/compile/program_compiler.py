"""Compiling decode programs in a separate process, into artifacts the engine loads (CPU and CUDA).

The engine never runs the compiler: a child process (`python -m linserve.server.engine.compile.program_compiler DIR`)
exports the decode program (compiled_decode.decode_program) for one batch bucket at a time with
torch.export and builds it with AOTInductor into `DIR/decode-s{slots}-b{size}.pt2` — on CPU C++ kernels
(frozen weights; max-autotune's GEMM templates if asked), on CUDA Triton kernels, which the engine then
captures in a CUDA graph. The engine loads a finished artifact in milliseconds and calls
it with no Dynamo guard evaluation; a restart, `linserve compile` or another server on the same cache
loads the artifacts without compiling anything.

So compiling holds none of the engine's GIL, never traces inside the engine's process (no torch.fx
patching while steps run), and runs at a lower CPU priority than serving. (On CUDA a compile in the serving
process stalled its streams for up to 2.6 s at a time on an H200: Dynamo and Inductor hold the GIL for
seconds; and a restart compiled everything again, 72 s for 7 buckets, where artifacts load in milliseconds.)

Protocol (one line each, text): the parent writes a bucket size; the child answers
`ready SIZE SECONDS` or `failed SIZE MESSAGE`; an empty line or EOF ends the child. `DIR/model.pt`
(config, dtype, weights, slot count) is written by the parent before the child starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import threading
import time

import torch

from linserve.model import families, kernels, numerics, projection
from linserve.model.interface import LINEAR_GPT, ServedModel, model_type
from linserve.model.weights import read_as_themselves, state_dict_for_compiler

logger = logging.getLogger(__name__)

CPU = torch.device("cpu")

MODEL_FILE = "model.pt"
ARTIFACT_FORMAT = 6  # part of the cache key: raise it whenever `build` makes different artifacts (3: no add
# fused into a projection, same_bits_as_eager; 4: projections through linserve's kernel; 5: their packed weights
# as inputs, listed in the artifact's weights manifest; 6: the large parameters read as they are, inputs too)


PARENT_PID = "LINSERVE_COMPILER_PARENT_PID"  # the server's pid, which the child checks once it will die with it


def artifact_path(directory: str, num_slots: int, size: int, program: str = "decode") -> str:
    """A bucket's program ("decode" or "verify{k}"); it reads the whole pool, so the slot count is compiled
    in (and named)."""
    return os.path.join(directory, f"{program}-s{num_slots}-b{size}.pt2")


@contextlib.contextmanager
def building(path: str):
    """Held while one process builds the artifact at `path`: an exclusive flock on `path.lock`, so two servers (or
    replicas, or test workers) sharing a cache directory build each bucket once — the second waits, then finds the
    artifact. The kernel drops the lock of a process that dies mid-build; on a file system without locks each
    builds on its own (the artifact still appears by rename, whole)."""
    try:
        handle = open(f"{path}.lock", "a")
    except OSError:
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def temporary_beside(path: str) -> str:
    """A name beside `path` that no other process, nor another thread of this one, writes (what is then renamed
    onto `path`: the decode and the verification programs' builds write the same model file)."""
    return f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"


def write_model(directory: str, model: ServedModel) -> None:
    """What the child needs to rebuild the program (config, dtype, weights), once per cache directory
    (which is keyed by exactly these), atomically."""
    path = os.path.join(directory, MODEL_FILE)
    if os.path.exists(path):
        return
    os.makedirs(directory, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    payload = {"config": model.config.to_dict(), "model_type": model_type(model.config),
               "dtype": dtype, "weights": projection.weight_format(),
               "state_dict": state_dict_for_compiler(model)}
    temp = temporary_beside(path)
    torch.save(payload, temp)
    os.replace(temp, path)


def weights_manifest(path: str) -> str:
    """Beside an artifact: the parameters that are its trailing inputs, in order — those read as they are, then
    those whose packed projection weights it reads."""
    return f"{os.path.splitext(path)[0]}.weights.json"


class WithWeights:
    """A compiled program that reads the model's weights as inputs: called with the program's arguments, it passes
    the engine's own tensors after them (shared_weights) — every bucket shares the process's one copy."""

    def __init__(self, program, weights: list[torch.Tensor]) -> None:
        self.program, self.weights = program, weights

    def __call__(self, *args: torch.Tensor):
        return self.program(*args, *self.weights)

    def bind(self, tail: tuple[torch.Tensor, ...]):
        """The program with `tail` and the weights after it bound (aoti_runner.BoundProgram), or None."""
        bind = getattr(self.program, "bind", None)
        return bind((*tail, *self.weights)) if bind is not None else None


def shared_weights(path: str, model: ServedModel) -> list[torch.Tensor]:
    """The tensors an artifact takes after the program's arguments: the listed parameters read as they are (the
    model's own tensors), then each listed projection's packed weight (and int8 scale), from this process's
    packing — the eager program's own."""
    with open(weights_manifest(path)) as manifest:
        listed = json.load(manifest)
    if listed["format"] != projection.weight_format():
        raise RuntimeError(f"{path} was built for {listed['format']} weights, this process serves "
                           f"{projection.weight_format()}")
    parameters = [model.get_parameter(name) for name in listed["parameters"]]
    if any(projection.released(parameter) for parameter in parameters):
        raise RuntimeError(f"{path} reads a parameter this process keeps only packed")
    packer = projection.PACKERS[listed["format"]]
    return [*(parameter.detach() for parameter in parameters),
            *projection.as_inputs(projection.packed(model.get_parameter(name), packer) for name in listed["weights"])]


def load_artifact(directory: str, num_slots: int, size: int, program: str = "decode",
                  device: torch.device = CPU, model: ServedModel | None = None):
    """A finished bucket's program (callable with the program's arguments), or None if there is none. A CPU
    program whose projections read their weights as inputs gets `model`'s (shared_weights)."""
    path = artifact_path(directory, num_slots, size, program)
    if not os.path.exists(path):
        return None
    if device.type == "cuda":  # torch's loader: it launches on the current stream (CUDA graphs capture it);
        # a call only queues kernels, so holding the GIL meanwhile costs little
        # single-threaded: none of the container's locking and events, which a CUDA graph cannot capture (only
        # the engine thread calls it)
        return torch._inductor.aoti_load_package(path, run_single_threaded=True, device_index=(
            device.index if device.index is not None else torch.cuda.current_device()))
    from .aoti_runner import load_program

    loaded = load_program(path)  # (linserve's kernels first: the program calls their C shims by name)
    if not os.path.exists(weights_manifest(path)):
        return loaded
    if model is None:
        raise ValueError(f"{path} reads the projections' weights as inputs: load it with the model")
    weights = shared_weights(path, model)
    return WithWeights(loaded, weights) if weights else loaded  # called without holding the GIL (aoti_runner.py)


class CompilerProcess:
    """The parent's handle on the child: `compile(size)` blocks (on a pipe, GIL released) until the child
    answers. The child lowers its own priority (nice +10) and logs to DIR/compile.log."""

    def __init__(self, directory: str, num_slots: int, autotune: bool, program: str = "decode",
                 device: torch.device = CPU, threads: int | None = None) -> None:
        directory = os.path.abspath(directory)
        # the child builds for this process's intra-op thread count (Inductor bakes it into the GEMM kernels)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(directory, "inductor"),
               "OMP_NUM_THREADS": str(threads or torch.get_num_threads()), PARENT_PID: str(os.getpid())}
        with open(os.path.join(directory, "compile.log"), "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "linserve.server.engine.compile.program_compiler", directory, str(num_slots),
                 "autotune" if autotune else "plain", program, str(device)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
            )

    def compile(self, size: int) -> float:
        """Seconds the child took; raises RuntimeError with the child's message when it could not."""
        self.process.stdin.write(f"{size}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"the compiler process ended (exit status {self.process.poll()})")
        word, _, rest = line.partition(" ")
        number, _, detail = rest.partition(" ")
        if word != "ready" or int(number) != size:
            raise RuntimeError(f"compiling bucket {size} failed: {detail or line}")
        return float(detail)

    def close(self) -> None:
        """End the child now, even mid-build (artifacts appear by rename: a killed build leaves none)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


# ---------------------------------------------------------------------------------------------- the child
def _load(directory: str, device: torch.device) -> ServedModel:
    """The served model as the parent has it, on its device: parameters in its dtype, buffers as saved (a
    head's decay stays fp32 — `in_dtype`, as `from_pretrained` loads it; cast to bf16 it would decay another
    state)."""
    from linserve.model.loading import in_dtype

    payload = torch.load(os.path.join(directory, MODEL_FILE), map_location="cpu", weights_only=True)
    projection.set_weight_format(payload.get("weights", "bf16"))  # the projections' format, as the server's
    model = families.build({**payload["config"], "model_type": payload.get("model_type", LINEAR_GPT)})
    model.load_state_dict(payload["state_dict"], assign=True)  # each tensor in its saved dtype
    return in_dtype(model, getattr(torch, payload["dtype"])).to(device).eval()


def build(directory: str, model: ServedModel, num_slots: int, size: int, autotune: bool,
          name: str = "decode") -> None:
    """Export and AOT-compile the program `name` ("decode", "verify{k}", "draft{k}" or "prefill{T}") for `size`
    rows on the model's device into its artifact (atomically); with `autotune` (CPU), Inductor times its GEMM
    choices (max-autotune: C++ GEMM templates over packed weights)."""
    import torch._inductor.config as inductor_config

    from ..decode_program import ProgramKind, program_pending
    from ..sampling import SlotSampling
    from ..state_pool import StatePool

    device = next(model.parameters()).device
    numerics.prepare_tables(device)  # real tensors, before export traces the program
    kernels.load()  # (the projections' op, whose C shim the program calls)
    if name.startswith("draft"):
        from ..spec.draft_model import DraftKind

        kind = DraftKind(name)
    elif name.startswith("prefill"):
        from ..prefill_program import PrefillKind

        kind = PrefillKind(name)
    else:
        kind = ProgramKind(name)
    program = kind.make(model)

    pool = StatePool(model, num_slots, device)
    sampling = SlotSampling(num_slots, model.config.vocab_size, device)
    io = torch.zeros(kind.io_rows, size, dtype=torch.long, device=device)  # (rows, P)
    args = (*kind.arguments(io), *pool.buffers.values(), *sampling.tensors(), *program_pending(pool, kind))
    tiled = projection_weights(model, program, args)
    packer = projection.PACKERS[projection.weight_format()]
    weights = projection.as_inputs(packer(weight) for _, weight in tiled)  # the trailing inputs
    shared = parameters_as_inputs(model, tiled) if device.type == "cpu" else []
    count, int8 = len(args), projection.weight_format() == "int8"

    class Over(torch.nn.Module):  # the program over the model (functional_call swaps the shared parameters in)
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return program(*inputs)

    class Program(torch.nn.Module):  # export wants a module; the rest of its parameters are frozen constants.
        # After the program's arguments: the large parameters read as they are (the embedding table), then the
        # projections' packed weights — the engine's own tensors at every call
        def __init__(self) -> None:
            super().__init__()
            self.over = Over()

        def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            given = dict(zip(shared, inputs[count:count + len(shared)]))
            swapped_in = {id(model.get_parameter(name)): tensor for name, tensor in given.items()}
            packed = iter(inputs[count + len(shared):])
            # each packed weight under the tensor the traced call reads: the parameter as export traces it (read
            # here, not before), or the input swapped in for it (a head tied to the table)
            tiles = {}
            for name, _ in tiled:
                weight = model.get_parameter(name)
                tiles[id(swapped_in.get(id(weight), weight))] = (next(packed), next(packed) if int8 else None)
            swapped = {f"model.{name}": tensor for name, tensor in given.items()}
            with projection.traced_tiles(tiles):
                return torch.func.functional_call(self.over, swapped, inputs[:count])

    args = (*args, *(model.get_parameter(name).detach() for name in shared), *weights)
    inductor_config.freezing = True  # weights become constants
    inductor_config.autotune_num_choices_displayed = 0
    inductor_config.max_autotune_report_choices_stats = False
    with torch.no_grad():
        exported = torch.export.export(Program(), args, strict=False)
    temp = os.path.join(directory, f".{name}-s{num_slots}-b{size}.{os.getpid()}.pt2")
    configs = ({**same_bits_as_eager(model), **kernels.inductor_configs(), "max_autotune": autotune}
               if device.type == "cpu"
               else {"freezing": True})  # (CUDA: no bit-for-bit promise against eager's cuBLAS calls)
    torch._inductor.aoti_compile_and_package(exported, package_path=temp, inductor_configs=configs)
    path = artifact_path(directory, num_slots, size, name)
    with open(f"{temp}.json", "w") as manifest:  # what the trailing inputs are (before the artifact appears)
        json.dump({"parameters": shared, "weights": [name for name, _ in tiled], "format": projection.weight_format()},
                  manifest)
    os.replace(f"{temp}.json", weights_manifest(path))
    os.replace(temp, path)


def projection_weights(model: ServedModel, program, args: tuple) -> list[tuple[str, torch.Tensor]]:
    """(name, weight) of every parameter the program's projections read through linserve's kernel: found by
    running the program once eagerly (each projection packs its weight on first use); none without the kernel."""
    if not kernels.load():
        return []
    with torch.no_grad():
        program(*[a.clone() for a in args])  # (clones: the program writes nothing, but the pool is the child's own)
    used = {id(weight) for weight in projection.packed_weights()}
    return [(name, weight) for name, weight in model.named_parameters() if id(weight) in used]


SHARED_PARAMETER_BYTES = 1 << 16  # an embedding table this large is a CPU program's input, not a constant


def parameters_as_inputs(model: ServedModel, tiled: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The parameters a CPU program takes as inputs as they are, rather than freezing a copy into each bucket's
    artifact (which AOTInductor copies again into memory of its own when the program loads): the embedding tables
    of at least SHARED_PARAMETER_BYTES (at 32k tokens × 1,024 a 64 MB copy a bucket). Only where the projections
    run through linserve's kernel (`tiled`): elsewhere a head tied to the table must stay a constant, which
    oneDNN packs for one row as eager's call does (same_bits_as_eager)."""
    if not tiled:
        return []
    tables = {id(weight) for weight in read_as_themselves(model)}
    return [name for name, weight in model.named_parameters()
            if id(weight) in tables and weight.numel() * weight.element_size() >= SHARED_PARAMETER_BYTES]


def same_bits_as_eager(model: ServedModel) -> dict:
    """Inductor settings under which a program computes what the eager model does, bit for bit
    (model/numerics.py): bf16 roundings where eager rounds (`emulate_precision_casts`: a fused kernel would
    otherwise keep fp32 between ops), bf16 weights packed by oneDNN for one row — as `projection.packed` packs
    them eagerly, whose rows do not depend on the batch — and fp32 weights left to the BLAS call eager makes
    (no prepacking: oneDNN's fp32 kernel rounds differently from MKL's). Max-autotune's own GEMM templates are
    off for the same reason: their rows are not eager's. And no addition joins a projection as oneDNN's post-op
    (`x + linear(h)` as one call): the fused sum rounds once where eager rounds the projection to bf16 and then
    the sum (fla's residual adds differed from eager by a bf16 ulp in the logits)."""
    from torch._inductor.fx_passes import mkldnn_fusion

    if not getattr(mkldnn_fusion._is_valid_binary, "keeps_projections_apart", False):
        original_check = mkldnn_fusion._is_valid_binary

        def unfused_projections(match, computation_op, binary_op):  # looked up by name when a pattern is checked
            if computation_op is torch.ops.mkldnn._linear_pointwise.default:
                return False
            return original_check(match, computation_op, binary_op)

        unfused_projections.keeps_projections_apart = True
        mkldnn_fusion._is_valid_binary = unfused_projections
    device_op = mkldnn_fusion.CpuMkldnnDeviceOp
    if not getattr(device_op.pack_linear_weight, "packs_for_one_row", False):
        original = device_op.pack_linear_weight

        def pack_for_one_row(self, graph, is_lp_weight, transpose_weight_node, batch_size):
            return original(self, graph, is_lp_weight, transpose_weight_node, 1 if is_lp_weight else batch_size)

        pack_for_one_row.packs_for_one_row = True
        device_op.pack_linear_weight = pack_for_one_row
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    return {"freezing": True, "emulate_precision_casts": True, "cpp.weight_prepack": bf16}


def quiet_compiler_warnings() -> None:
    """Warnings torch's own compiler code raises about itself (its use of deprecated storages and pytree
    classes): nothing a user can act on, so they stay out of the logs."""
    import warnings

    warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)


def _die_with_parent() -> None:
    """Linux: the kernel kills this child when the server that started it dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # the parent may have died before the call (while this interpreter imported torch): then this process
        # was handed to init or to a subreaper (a CI runner, a container's init), whatever its pid
        if str(os.getppid()) != os.environ.get(PARENT_PID, str(os.getppid())):
            os.write(2, b"the server that started this compiler is gone\n")
            os._exit(1)
    except (OSError, AttributeError):
        pass  # not Linux: the server's close() still ends it


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    directory, num_slots, how = args[:3]
    name = args[3] if len(args) > 3 else "decode"
    device = torch.device(args[4] if len(args) > 4 else "cpu")
    num_slots, autotune = int(num_slots), how == "autotune"
    answers = os.fdopen(os.dup(1), "w")  # the protocol's own copy of stdout; whatever the compiler prints
    os.dup2(2, 1)  # (autotuning tables, warnings) goes to the log instead
    os.nice(10)  # serving comes first
    _die_with_parent()
    quiet_compiler_warnings()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = _load(directory, device)
    for line in sys.stdin:
        if not line.strip():
            break
        size = int(line)
        started = time.perf_counter()
        try:
            path = artifact_path(directory, num_slots, size, name)
            with building(path):  # (another process sharing the directory may be building it: then it waits)
                if not os.path.exists(path):
                    build(directory, model, num_slots, size, autotune, name)
            answers.write(f"ready {size} {time.perf_counter() - started:.3f}\n")
        except Exception as error:  # noqa: BLE001 - reported to the parent, which serves eagerly
            logger.exception("compiling bucket %d failed", size)
            answers.write(f"failed {size} {json.dumps(f'{type(error).__name__}: {error}')[:2000]}\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
