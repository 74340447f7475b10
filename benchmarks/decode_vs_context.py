"""SPEC P1 (decode step vs context) and P6 (decode step vs weight-read time), measured side by side.

Batch-1 decode-step medians after prefilling each context, for the linear model, the softmax baseline
(same weights layout, KV cache) and Hugging Face `GPT2LMHeadModel` with the same dims and its KV cache.
Contexts and models are measured round-robin (interleaved repetitions); medians and spread reported.
P6 measures memory bandwidth in the same run (a large tensor copy) and compares the linear step with
the time to read its weights once.

    python benchmarks/decode_vs_context.py [--contexts 128 2048 8192 32768] [--reps 5] [--quick] [--out F]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from common import add_device_argument, add_threads_argument, describe, emit, resolve_device, synchronize

from linserve.model import LinearGPT, ModelConfig
from linserve.model.generate import decode_one_token, prefill

SOFTMAX_MAX_CONTEXT = 8192  # beyond this the naive baseline's prefill alone takes minutes on CPU


def median_step(step, steps: int, device: torch.device) -> float:
    times = []
    for _ in range(steps):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def gpt2_of(config: ModelConfig, max_context: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2Config(vocab_size=config.vocab_size, n_positions=max_context + 8, n_embd=config.d_model,
                      n_layer=config.n_layers, n_head=config.n_heads, n_inner=config.d_mlp,
                      bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(gpt2).eval()


def last_level_cache_bytes(device: torch.device) -> int:
    """The largest cache between the cores and memory: the CPU's last-level cache (sysfs), a GPU's L2."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20))
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)


def read_bandwidth_gbs(device: torch.device, nbytes: int, reps: int = 7, threads: int | None = None) -> float:
    """Read bandwidth (GB/s): an fp32 buffer of `nbytes` summed, bytes read / median time; with every CPU
    this process may use (a reduction's threads), whatever the decode step's own thread count — or `threads`.
    On a CPU the buffer lies on memory advised as huge pages, as the packed weights do (model/host_memory.py): the
    floor is what the memory gives at its best, not on 4 KB pages (which read slower)."""
    from linserve.model import host_memory
    from linserve.server.engine.cpu_threads import usable_cpus

    before = torch.get_num_threads()
    torch.set_num_threads(threads or max(1, int(usable_cpus())))
    try:
        buffer = host_memory.zeros((max(nbytes // 4, 1),), torch.float32, device).fill_(1.0)
        buffer.sum()  # first touch
        times = []
        for _ in range(reps):
            synchronize(device)
            started = time.perf_counter()
            buffer.sum()
            synchronize(device)
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(before)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


def bandwidths(device: torch.device, weight_bytes: int, quick: bool) -> dict:
    """P6's floor, defined so that it means the same on every machine: DRAM read bandwidth over a buffer of
    4x the last-level cache (at least 256 MB) — nothing of it can stay cached; beside it, the cache case: a
    buffer the size of the weights, read again and again (it stays in the cache if it fits)."""
    llc = last_level_cache_bytes(device)
    dram_bytes = 64 * 2**20 if quick else max(4 * llc, 256 * 2**20)
    return {"last_level_cache_bytes": llc, "dram_buffer_bytes": dram_bytes,
            "dram_gb_s": read_bandwidth_gbs(device, dram_bytes), "cache_buffer_bytes": weight_bytes,
            "cache_gb_s": read_bandwidth_gbs(device, weight_bytes),
            # what one core reads: the floor of a step that runs on one thread (serve's decode default on a
            # small host leaves the other CPU to the event loop)
            "dram_gb_s_one_thread": read_bandwidth_gbs(device, dram_bytes, threads=1),
            "cache_gb_s_one_thread": read_bandwidth_gbs(device, weight_bytes, threads=1)}


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048, 8192, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="small contexts and few repetitions (tests)")
    parser.add_argument("--out")
    parser.add_argument("--plot", help="PNG of step time vs context")
    parser.add_argument("--compile-cache", default=None, help="Inductor's on-disk caches (default: the server's)")
    add_device_argument(parser)
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    from linserve.server.engine.cpu_threads import apply_threads

    plan = apply_threads(args.threads)  # the server's count (this thread runs every step measured here)
    if args.quick:
        args.contexts, args.reps, args.steps = [16, 256], 1, 3
    torch.manual_seed(0)
    linear_cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=8, decay=True, conv_kernel=4)
    softmax_cfg = ModelConfig(vocab_size=4096, d_model=256, n_layers=6, n_heads=8, attention="softmax")
    linear, softmax = LinearGPT(linear_cfg).eval().to(device), LinearGPT(softmax_cfg).eval().to(device)
    gpt2 = gpt2_of(linear_cfg, max(args.contexts)).to(device)
    token = torch.tensor([1], device=device)

    steps = {}  # (model, context) → callable running one decode step from the same starting state
    for context in args.contexts:
        ids = torch.randint(0, 4096, (1, context), device=device)
        _, state = prefill(linear, ids)
        steps[("linear", context)] = lambda s=state: decode_one_token(linear, token, s)
        if context <= SOFTMAX_MAX_CONTEXT:
            _, kv = prefill(softmax, ids)
            steps[("softmax", context)] = lambda s=kv: decode_one_token(softmax, token, s)
            cache = gpt2(ids, use_cache=True).past_key_values
            steps[("hf_gpt2", context)] = lambda c=cache, n=context: _gpt2_step(gpt2, c, n)
    samples = {key: [] for key in steps}
    for _ in range(args.reps):
        for key, step in steps.items():
            samples[key].append(median_step(step, args.steps, device))
    weight_bytes = sum(p.numel() * p.element_size() for p in linear.parameters())
    bandwidth = bandwidths(device, weight_bytes, args.quick)

    table = {}
    for (name, context), values in samples.items():
        table.setdefault(name, {})[context] = {"median_ms": 1e3 * statistics.median(values),
                                               "spread_ms": [1e3 * min(values), 1e3 * max(values)]}
    first, last = args.contexts[0], args.contexts[-1]
    p1 = table["linear"][last]["median_ms"] / table["linear"][first]["median_ms"]
    engine_steps = engine_step_table(linear, device, args, bandwidth, plan.kernel_threads)
    best = min(engine_steps.values(), key=lambda row: row["ratio"])
    result = {
        **describe(device),
        "decode_step": table,
        "P1": {
            "ratio": p1,
            "measured": "linear step at the last context / at the first",
            "contexts": [first, last],
            "target": "<= 1.05",
            "pass": p1 <= 1.05,
        },
        "engine_step": engine_steps,
        "P6": {
            "bandwidth_gb_s": bandwidth["dram_gb_s"],
            "bandwidth": bandwidth,
            "measured": "the engine's batch-1 step (gather, model, sampling, scatter) / one read of the weights at "
            "the DRAM read bandwidth (buffer 4x the last-level cache), best setting",
            "setting": best["setting"],
            "step_ms": best["step_ms"],
            "weight_read_ms": best["weight_read_ms"],
            "ratio": best["ratio"],
            "ratio_cache": best["ratio_cache"],
            "ratio_one_thread": best["ratio_one_thread"],  # against what one core reads (the step's threads)
            "target": "<= 1.5",
            "pass": best["ratio"] <= 1.5,
        },
    }
    emit(result, args.out)
    if args.plot:
        plot_steps(table, args.plot)


def engine_step_table(model: LinearGPT, device: torch.device, args, bandwidth: dict, kernel_threads: int = 1) -> dict:
    """The engine's batch-1 decode step (the whole program — gather, model, sampling — and the scatter into the
    pool) per weights dtype, eager and compiled, each against the time to read that dtype's weights once.
    --quick measures eager only. A compiled CPU program runs on the decode count and, where the server's plan has
    more (`kernel_threads`: the count its engine times served against the decode count for each bucket and keeps
    where faster, thread_trial.py), on that count too — its projections then split over the threads."""
    from linserve.server.engine.compile.compiled_decode import DecodeStep
    from linserve.server.engine.sampling import SlotSampling
    from linserve.server.engine.state_pool import StatePool

    modes = ("off",) if args.quick else ("off", "on")
    steps = {}  # setting → (step, its pool, weight bytes, threads)
    decode_count = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        typed = copy.deepcopy(model).to(dtype)
        pool = StatePool(typed, 2, device)
        for mode in modes:
            sampling = SlotSampling(pool.num_slots, typed.config.vocab_size, device)
            step = DecodeStep(typed, pool, sampling, device, mode, max_rows=1, cache_dir=args.compile_cache)
            step.start()
            step.wait_compiled()
            setting = f"{str(dtype).removeprefix('torch.')} {'compiled' if mode == 'on' else 'eager'}"
            weight_bytes = sum(p.numel() * p.element_size() for p in typed.parameters())
            steps[setting] = (step, pool, weight_bytes, decode_count)
            if mode == "on" and device.type == "cpu" and kernel_threads > decode_count:
                steps[f"{setting}, {kernel_threads} kernel threads"] = (step, pool, weight_bytes, kernel_threads)
    rows = {setting: [] for setting in steps}
    for _ in range(args.reps):  # interleaved repetitions, as above
        for setting, (step, _, _, count) in steps.items():
            torch.set_num_threads(count)
            rows[setting].append(median_step(lambda s=step: s([1], [0], [0]), args.steps, device))  # (writes slot 0)
    torch.set_num_threads(decode_count)
    table = {}
    for setting, values in rows.items():
        _, _, weight_bytes, count = steps[setting]
        read_ms = weight_bytes / (bandwidth["dram_gb_s"] * 1e9) * 1e3
        cached_ms = weight_bytes / (bandwidth["cache_gb_s"] * 1e9) * 1e3  # fp32-sized buffer: bf16 fits better
        one_thread = bandwidth["cache_gb_s_one_thread" if weight_bytes <= bandwidth["last_level_cache_bytes"]
                               else "dram_gb_s_one_thread"]
        one_thread_ms = weight_bytes / (one_thread * 1e9) * 1e3  # where the weights sit, read by one core
        step_ms = 1e3 * statistics.median(values)
        table[setting] = {
            "setting": setting,
            "threads": count,
            "weight_bytes": weight_bytes,
            "weight_read_ms": read_ms,
            "weight_read_cached_ms": cached_ms,
            "step_ms": step_ms,
            "spread_ms": [1e3 * min(values), 1e3 * max(values)],
            "ratio": step_ms / read_ms,
            "ratio_cache": step_ms / cached_ms,
            "weight_read_one_thread_ms": one_thread_ms,
            "ratio_one_thread": step_ms / one_thread_ms,
        }
    return table


def plot_steps(table: dict, path: str) -> None:
    """Decode-step median vs context, one line per model (log-scaled context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = {"linear": "linear (linserve)", "softmax": "softmax baseline, KV cache", "hf_gpt2": "HF GPT-2, KV cache"}
    for name, rows in table.items():
        contexts = sorted(rows)
        ax.plot(contexts, [rows[c]["median_ms"] for c in contexts], "-o", label=labels.get(name, name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("batch-1 decode step (ms)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("P1: decode step vs context")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gpt2_step(gpt2, cache, context: int):
    """One GPT-2 decode step; the cache is cropped back so every step starts from the same context."""
    out = gpt2(torch.tensor([[1]], device=gpt2.device), past_key_values=cache, use_cache=True)
    out.past_key_values.crop(-1)
    return out


if __name__ == "__main__":
    main()
