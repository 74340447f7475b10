"""Statistics, JSON and the PNG plot of a `linserve bench` run."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from .client import LoadSpec, RequestRecord
from .processes import LoadRun

BUSY_CLIENT = 0.85  # a load-generator process busier than this share of a core may be what limits the run


def describe(values: list[float], scale: float = 1e3) -> dict:
    """mean, p50, p90, p99 (milliseconds by default) of a sample; zeros for an empty one."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * scale

    return {"mean": statistics.fmean(ordered) * scale, "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99),
            "count": len(ordered)}


def itl_by_position(records: list[RequestRecord], prompt_tokens: int, bin_size: int) -> list[dict]:
    """ITL p50/p99 (ms) of tokens binned by their position in the sequence (prompt included)."""
    bins: dict[int, list[float]] = {}
    for record in records:
        base = record.prompt_tokens if record.prompt_tokens is not None else prompt_tokens
        for i in range(1, len(record.token_times)):
            position = base + i
            bins.setdefault(position // bin_size, []).append(record.token_times[i] - record.token_times[i - 1])
    return [{"start": b * bin_size, "end": (b + 1) * bin_size, **describe(v)} for b, v in sorted(bins.items())]


def summarize(spec: LoadSpec, run: LoadRun, bin_size: int) -> dict:
    records, wall_s = run.records, run.wall_s
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens if r.completion_tokens is not None else len(r.token_times) for r in ok)
    errors = Counter(str(r.status or "connection") for r in records if not r.ok)
    return {
        "url": spec.url,
        "model": run.model,
        "load": {"concurrency": None if spec.rate else spec.concurrency, "rate": spec.rate,
                 "prompt_tokens": spec.prompt_tokens, "max_tokens": spec.max_tokens, "ignore_eos": spec.ignore_eos,
                 "seed": spec.seed, "warmup": spec.warmup},
        "requests": len(records),
        "succeeded": len(ok),
        "errors_by_status": dict(errors),
        "wall_s": wall_s,
        "request_throughput_per_s": len(ok) / wall_s if wall_s else 0.0,
        "token_throughput_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_ms": describe([r.token_times[0] for r in ok]),
        "itl_ms": describe([b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]),
        "e2e_ms": describe([r.token_times[-1] for r in ok]),
        "itl_by_position": itl_by_position(ok, spec.prompt_tokens, bin_size),
        "ttft_samples_ms": [r.token_times[0] * 1e3 for r in ok],
        "client": client_load(run, tokens),
    }


def client_load(run: LoadRun, tokens: int) -> dict:
    """What the load generator itself cost: its processes, CPU seconds, per token, and its busiest process's
    share of a core (near 1: the client, not the server, may be what limits the throughput)."""
    cpu = sum(run.cpu_s)
    return {"processes": run.processes, "cpu_s": cpu, "cpu_us_per_token": 1e6 * cpu / tokens if tokens else 0.0,
            "busiest_process_share": max(run.cpu_s, default=0.0) / run.wall_s if run.wall_s else 0.0}


def plot(results: dict[str, dict], path: str | Path) -> None:
    """ITL p50/p99 against token position, and the TTFT distribution, one colour per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_itl, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (label, result), color in zip(results.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red")):
        rows = result["itl_by_position"]
        centers = [(r["start"] + r["end"]) / 2 for r in rows]
        ax_itl.plot(centers, [r["p50"] for r in rows], "-o", color=color, label=f"{label} p50", markersize=3)
        ax_itl.plot(centers, [r["p99"] for r in rows], "--", color=color, label=f"{label} p99")
        if result["ttft_samples_ms"]:
            ax_ttft.hist(result["ttft_samples_ms"], bins=30, alpha=0.6, color=color, label=label)
    ax_itl.set_xlabel("token position in sequence")
    ax_itl.set_ylabel("inter-token latency (ms)")
    ax_itl.set_ylim(bottom=0)
    ax_itl.set_title("ITL vs position")
    ax_itl.legend(fontsize=8)
    ax_ttft.set_xlabel("time to first token (ms)")
    ax_ttft.set_ylabel("requests")
    ax_ttft.set_title("TTFT distribution")
    ax_ttft.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_text(label: str, result: dict) -> str:
    lines = [f"== {label}: {result['url']} ({result['model']})",
             f"requests {result['succeeded']}/{result['requests']} ok, errors {result['errors_by_status'] or 'none'}, "
             f"{result['request_throughput_per_s']:.2f} req/s, {result['token_throughput_per_s']:.1f} tokens/s"]
    server = result.get("server")
    if server:
        step = server.get("decode_step") or {}
        lines.append(f"server: linserve {server.get('version')} on {server.get('device')}, {server.get('dtype')} "
                     f"weights, {server.get('threads')} CPU threads, decode step {step.get('status', 'n/a')}")
    client = result.get("client")
    if client:
        lines.append(f"client: {client['processes']} process(es), {client['cpu_us_per_token']:.0f} us of CPU a token, "
                     f"busiest at {100 * client['busiest_process_share']:.0f}% of a core"
                     + (" - the load generator may be what limits this run: more --processes"
                        if client["busiest_process_share"] > BUSY_CLIENT else ""))
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        d = result[name]
        lines.append(f"{name[:-3].upper():>5} ms  mean {d['mean']:9.2f}  p50 {d['p50']:9.2f}  p90 {d['p90']:9.2f}  "
                     f"p99 {d['p99']:9.2f}")
    for row in result["itl_by_position"]:
        lines.append(f"  ITL @ {row['start']:>6}-{row['end']:<6} p50 {row['p50']:7.2f} ms  p99 {row['p99']:7.2f} ms  "
                     f"(n={row['count']})")
    return "\n".join(lines)
