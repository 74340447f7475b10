"""SPEC P17 — fla's 340M shapes served with linserve's defaults on this machine: `linear_attn` (ELU+1 feature
map) and `gla`, 24 layers × 1,024 (fla's defaults otherwise; linserve's 4,096-token tokenizer), random weights
made here, against llama.cpp's `llama-server` serving a Mamba of the same class (mamba-370m's shape, GGUF BF16).

    bash benchmarks/peers/build_llama_server.sh && python benchmarks/peers/make_models.py mamba-370m   # once
    python benchmarks/p17_families.py [--reps 2] [--families linear_attn gla] [--quick] [--out FILE]

`--families gated_deltanet`: fla's Gated DeltaNet 340M config (21 layers × 1,024, 6 heads of 256).
`--families mamba2 --peer mamba2-370m`: mamba2-370m's shape (48 × 1,024, 32 heads of 64, state 128) beside
llama.cpp's Mamba2 of the same shape (`make_models.py mamba2-370m`); `--families rwkv7 --peer rwkv7-0.4b`:
fla-hub's RWKV-7 0.4B shape (24 × 1,024) beside llama.cpp serving the same weights (`make_models.py rwkv7-0.4b`
converts P17's own checkpoint).

Measured, side by side in one run:
- ITL flat: 1 stream × 8,192 tokens, ITL p50 of the last 1,024 tokens / the first 1,024 (≤ 1.10);
- the engine's batch-1 decode step (compiled, bf16, on the server's decode threads: every CPU for weights
  this large) against one read of the weights at the DRAM read bandwidth (≤ 1.5×; decode_vs_context.py's
  definition, measured again before each of the three timings: the median) and, beside it, against the
  weights plus the state read and written once (`ratio_with_state`: Gated DeltaNet's and Mamba2's states are
  7–8% of their weights);
- tokens/s at 1 stream × 512 and 8 streams × 256 against llama-server's (≥ 1.0×), servers in turn per load;
- memory: state bytes per session (the family's formula, /v1/models) and each server's RSS after the loads, against
  weights (bf16) + state pool (8 slots) + 1 GiB;
- the bytes each server must move a token (`bytes_per_token`): the weights a step reads (the peer's GGUF tensors
  but a tied table's one copy; the token-embedding rows are a lookup) plus each row's state read and written once,
  per token at 1 and 8 streams — the tokens/s ratio two servers would show at equal bandwidth, and how many bytes a
  second linserve moves for each one the peer moves (`bandwidth_vs_peer`).
Servers: `linserve serve --model DIR --num-slots 8` (every other setting its default: dtype auto, compile auto,
threads; `linserve compile` builds their buckets first) and `llama-server -np 8 -cb -t 2`. --quick: 2-layer ×
64 models, short loads, eager, no peer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import torch  # noqa: E402
from common import emit, machine_check, reference_workload_ms, tree_rss_bytes  # noqa: E402
from decode_vs_context import bandwidths, median_step, read_bandwidth_gbs  # noqa: E402
from p9_peers import LLAMA_SERVER, PEERS, itl_p50_ms, one_load, start_llama  # noqa: E402
from serving_overhead import start_server  # noqa: E402

from linserve.model import families  # noqa: E402
from linserve.model.checkpoint import load_checkpoint  # noqa: E402
from linserve.model.loading import DEFAULT_CHECKPOINT, resolve_dtype  # noqa: E402
from linserve.server.settings import Settings  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# fla's model sizes (hidden, layers); the vocabulary is the shipped tokenizer's (random weights need no other)
SHAPES = {"340M": dict(hidden_size=1024, num_hidden_layers=24, vocab_size=4096),
          "1.3B": dict(hidden_size=2048, num_hidden_layers=24, vocab_size=4096),
          "quick": dict(hidden_size=64, num_hidden_layers=2, vocab_size=4096)}
FAMILIES = {"linear_attn": {"model_type": "linear_attn", "feature_map": "elu"}, "gla": {"model_type": "gla"},
            "retnet": {"model_type": "retnet"},
            # fla's Gated DeltaNet 340M / 1.3B configs: 6 heads of 256 (values 512), 21 layers
            "gated_deltanet": {"model_type": "gated_deltanet", "num_heads": 6, "head_dim": 256, "expand_v": 2,
                               "num_hidden_layers": 21},
            # state-spaces/mamba2-370m's shape: 48 layers × 1,024, 32 heads of 64, state 128, one group
            "mamba2": {"model_type": "mamba2", "num_hidden_layers": 48, "head_dim": 64, "state_size": 128,
                       "n_groups": 1, "expand": 2},
            # fla-hub's RWKV-7 0.4B: 24 layers × 1,024, heads of 64, FFN 4,096, fla's default LoRA ranks
            "rwkv7": {"model_type": "rwkv7", "head_dim": 64, "intermediate_size": 4096, "decay_low_rank_dim": 64,
                      "gate_low_rank_dim": 128, "a_low_rank_dim": 64, "v_low_rank_dim": 16, "norm_eps": 1e-5}}
P17_FAMILIES = ("linear_attn", "gla")


def make_checkpoint(name: str, shape: str = "340M") -> Path:
    """data/p17/NAME[-SHAPE]: the family at one of fla's shapes, fla-style init (normal 0.02, norms 1), seeded;
    cached."""
    from safetensors.torch import save_file

    directory = REPO / "data" / "p17" / (name if shape == "340M" else f"{name}-{shape}")
    if (directory / "model.safetensors").exists():
        return directory
    raw = {**SHAPES[shape], **FAMILIES[name]}
    torch.manual_seed(0)
    model = families.build(raw)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.02 if parameter.dim() > 1 else torch.ones_like(parameter))
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    for source in DEFAULT_CHECKPOINT.iterdir():
        if source.name not in ("config.json", "model.safetensors"):
            shutil.copy(source, directory / source.name)
    return directory


def peer_bytes(gguf: Path) -> dict:
    """What llama.cpp reads a token of this GGUF (every tensor but the token embeddings, which are read as the
    output head where the model ties them) and its recurrent state's bytes a sequence (Mamba, Mamba2, RWKV-7: fp32)."""
    sys.path.insert(0, str(PEERS / "llama.cpp" / "gguf-py"))
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    weights = sum(sizes.values()) - (sizes["token_embd.weight"] if "output.weight" in sizes else 0)
    value = lambda key: reader.fields[key].parts[reader.fields[key].data[0]]  # noqa: E731 (a field's value's array)
    field = lambda key: int(value(key)[0])  # noqa: E731
    arch = bytes(value("general.architecture")).decode()
    layers, width = field(f"{arch}.block_count"), field(f"{arch}.embedding_length")
    if arch in ("mamba", "mamba2"):  # the SSM's (d_inner, d_state) and the convolution's last d_conv - 1 inputs
        inner, state, conv = (field(f"{arch}.ssm.{k}") for k in ("inner_size", "state_size", "conv_kernel"))
        conv_channels = inner + (2 * field("mamba2.ssm.group_count") * state if arch == "mamba2" else 0)
        per_layer = inner * state + (conv - 1) * conv_channels
    elif arch == "rwkv7":  # heads of (d, d) plus the two token shifts
        head = field("rwkv7.wkv.head_size")
        per_layer = width * head + 2 * width
    else:
        raise ValueError(f"no state formula for {arch}")
    return {"weights": weights, "state": 4 * layers * per_layer}


def bytes_per_token(weights: int, state: int, streams: int) -> float:
    """A step's reads and writes a token: the weights once for every row, each row's state read and written once."""
    return (weights + streams * 2 * state) / streams


def decode_step_vs_weights(directory: Path, bandwidth: dict, steps: int, compile_mode: str,
                           quantization: str = "none") -> dict:
    """The engine's batch-1 decode step (gather, model, sampling, scatter) in the default dtype, compiled; against
    one read of the weights as the step reads them (int8: the projections' at a byte a weight)."""
    from linserve.model import numerics, projection
    from linserve.server.engine.compile.compiled_decode import DecodeStep
    from linserve.server.engine.cpu_threads import apply_threads, weight_bytes
    from linserve.server.engine.sampling import SlotSampling
    from linserve.server.engine.state_pool import StatePool

    numerics.flush_subnormals()  # as the engine's thread does
    device = torch.device("cpu")
    dtype = resolve_dtype("auto", device)
    projection.use_quantization(quantization, device, dtype)
    model = load_checkpoint(directory, device, dtype)
    threads = apply_threads(None, None, weight_bytes(model))  # the server's decode thread count (cpu_threads.py)
    pool = StatePool(model, 2, device)
    sampling = SlotSampling(pool.num_slots, model.config.vocab_size, device)
    step = DecodeStep(model, pool, sampling, device, compile_mode, max_rows=1,  # serve's defaults: not autotuned
                      cache_dir=str(REPO / "data" / "p17" / "compile"), autotune=Settings().compile_autotune)
    step.start()
    step.wait_compiled()
    times, beside = [], []
    for _ in range(3):  # the host's DRAM figure drifts within minutes: measured again beside each timing
        beside.append(read_bandwidth_gbs(device, bandwidth["dram_buffer_bytes"]))
        times.append(median_step(lambda: step([1], [0], [0]), steps, device))  # (it writes slot 0's state itself)
    dram = statistics.median(beside)
    read_bytes = threads.weight_bytes
    if quantization == "int8":  # the projections' weights at one byte each, the rest (embeddings, norms) as they are —
        own = {id(parameter) for parameter in model.parameters()}  # this model's: not an earlier family's still alive
        read_bytes -= sum(w.numel() for w in projection.packed_weights() if id(w) in own)
    read_ms = read_bytes / (dram * 1e9) * 1e3
    state_bytes = model.config.state_bytes()  # read and written once a step besides the weights
    moved_ms = (read_bytes + 2 * state_bytes) / (dram * 1e9) * 1e3
    step_ms = 1e3 * statistics.median(times)
    step.close(wait=True)
    return {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "compiled": step.status,
            "threads": threads.threads, "dram_gb_s_beside": beside, "weight_bytes": read_bytes,
            "weight_read_ms": read_ms, "step_ms": step_ms, "ratio": step_ms / read_ms,
            "target": "<= 1.5", "pass": step_ms / read_ms <= 1.5,
            "weights_and_state_ms": moved_ms, "ratio_with_state": step_ms / moved_ms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per timing of the in-process step")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--llama-threads", type=int, default=2)
    parser.add_argument("--families", nargs="+", default=list(P17_FAMILIES), choices=list(FAMILIES),
                        help="fla families at their 340M shape (default: linear_attn gla)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"],
                        help="int8: linserve serves int8 weights, beside llama.cpp's Q8_0 of the same Mamba")
    parser.add_argument("--peer", default=None, choices=["mamba-370m", "mamba2-370m", "rwkv7-0.4b"],
                        help="llama.cpp's model beside linserve (default mamba-370m; Q8_0 with --quantization int8)")
    parser.add_argument("--no-long", action="store_true", help="skip the 1 x 8,192 load (ITL late/early)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    loads = {"1x512": (1, 512), "8x256": (8, 256), "1x8192": (1, 8192)}
    if args.no_long:
        del loads["1x8192"]
    peer_model = args.peer or ("mamba-370m-q8_0" if args.quantization == "int8" else "mamba-370m")
    quantized = ["--quantization", args.quantization]
    if args.quick:
        args.reps, args.steps, loads = 1, 5, {"1x32": (1, 32), "8x16": (8, 16), "1x128": (1, 128)}
        if args.no_long:
            del loads["1x128"]
    window = 1024 if not args.quick else 32
    with_peer = not args.quick
    if with_peer and not (LLAMA_SERVER.exists() and (PEERS / "models" / f"{peer_model}.gguf").exists()):
        raise SystemExit("build the peer first: bash benchmarks/peers/build_llama_server.sh && "
                         f"python benchmarks/peers/make_models.py {peer_model}")
    checkpoints = {name: make_checkpoint(name, "quick" if args.quick else "340M") for name in args.families}
    reference_before = reference_workload_ms()
    bf16_bytes = {name: sum(p.numel() for p in load_checkpoint(d, torch.device("cpu")).parameters()) * 2
                  for name, d in checkpoints.items()}
    weight_bytes = max(bf16_bytes.values())
    bandwidth = bandwidths(torch.device("cpu"), weight_bytes, args.quick)
    steps = {name: decode_step_vs_weights(d, bandwidth, args.steps, "off" if args.quick else "on", args.quantization)
             for name, d in checkpoints.items()}
    if not args.quick and args.compile != "off":  # every bucket `serve --num-slots 8` uses, into serve's cache
        for directory in checkpoints.values():
            subprocess.run([sys.executable, "-m", "linserve.server.cli", "compile", "--model", str(directory),
                            "--num-slots", "8", *quantized], check=True, stdout=subprocess.DEVNULL)
    servers = {f"linserve {name}": 8971 + i for i, name in enumerate(checkpoints)}
    processes = {}
    peer_label = f"llama.cpp {peer_model}"
    labels = [*servers, *([peer_label] if with_peer else [])]
    rates = {(s, load): [] for s in labels for load in loads}
    flat = {s: [] for s in labels}
    try:  # (a server that fails to start: the ones already started are stopped too)
        for (label, port), directory in zip(servers.items(), checkpoints.values()):
            processes[label] = start_server(str(directory), port, 8, extra=["--log-level", "warning", *quantized],
                                            env={"LINSERVE_SESSION_STORE": "none"},
                                            compile="off" if args.quick else args.compile)
        if with_peer:
            servers[peer_label] = 8979
            processes[peer_label] = start_llama(PEERS / "models" / f"{peer_model}.gguf", 8979,
                                                max(tokens for _, tokens in loads.values()) + 64, args.llama_threads)
        cards = {label: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]
                 for label, port in servers.items() if label.startswith("linserve")}
        for port in servers.values():
            one_load(port, 1, 8)  # warm-up
        long_load = list(loads)[2] if len(loads) > 2 else None  # (the long one; --no-long: none)
        during = []  # the DRAM figure before each repetition of the loads
        for _ in range(args.reps):
            during.append(read_bandwidth_gbs(torch.device("cpu"), bandwidth["dram_buffer_bytes"]))
            for load, (streams, tokens) in loads.items():
                if load == long_load and _ > 0:
                    continue  # the 8,192-token load once per server: minutes each at this size
                for name, port in servers.items():
                    summary, records = one_load(port, streams, tokens)
                    rates[(name, load)].append(summary["token_throughput_per_s"])
                    if load == long_load:
                        flat[name].append(itl_p50_ms(records, tokens - window, tokens) / itl_p50_ms(records, 0, window))
        rss = {label: tree_rss_bytes(process.pid) for label, process in processes.items()}  # (the core too)
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(60)
    table = {name: {load: statistics.median(rates[(name, load)]) for load in loads} for name in servers}
    result = {"loads": loads, "reps": args.reps, "bandwidth": {**bandwidth, "dram_gb_s_during_loads": during},
              "machine": machine_check(reference_before, reference_workload_ms()), "tokens_per_s": table,
              "rss_bytes": rss, "P17": {}}
    for name in checkpoints:
        label = f"linserve {name}"
        card = cards[label]
        limit = bf16_bytes[name] + 8 * card["state_bytes"] + 2**30  # weights + the pool (--num-slots 8) + 1 GiB
        entry = {"state_bytes_per_session": card["state_bytes"], "rss_bytes": rss[label],
                 "rss": {"bytes": rss[label], "limit": limit, "target": "<= weights + state pool + 1 GiB",
                         "pass": rss[label] <= limit},
                 "decode_step": steps[name],
                 "quantization": args.quantization}
        if flat[label]:
            ratio = flat[label][0]
            entry["itl_late_over_early"] = {"ratio": ratio, "target": "<= 1.10", "pass": ratio <= 1.10}
        if with_peer:
            peer_moves = peer_bytes(PEERS / "models" / f"{peer_model}.gguf")
            for load in list(loads)[:2]:
                peer = table[peer_label][load]
                entry[load] = {"linserve": table[label][load], "peer": peer, "ratio": table[label][load] / peer,
                               "target": ">= 1.0", "pass": table[label][load] >= peer}
                streams = loads[load][0]
                ours = bytes_per_token(steps[name]["weight_bytes"], card["state_bytes"], streams)
                theirs = bytes_per_token(peer_moves["weights"], peer_moves["state"], streams)
                entry[load]["bytes_per_token"] = {"linserve": ours, "peer": theirs,
                                                  "ratio_at_equal_bandwidth": theirs / ours,
                                                  "bandwidth_vs_peer": entry[load]["ratio"] * ours / theirs}
        result["P17"][name] = entry
    emit(result, args.out)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# {time.time() - t0:.0f} s", file=sys.stderr)
