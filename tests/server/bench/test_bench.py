"""`linserve bench` against a real `linserve serve` process."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from linserve.server.bench.client import RequestRecord
from linserve.server.bench.report import describe, itl_by_position

pytestmark = pytest.mark.slow


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linserve.server.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300)


def test_closed_loop_writes_json_and_plot(server, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = bench("--url", server["base"], "--concurrency", "3", "--requests", "6", "--max-tokens", "20",
                   "--prompt-tokens", "8", "--out", str(out), "--plot", str(png))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    (only,) = data.values()
    assert only["succeeded"] == 6 and only["errors_by_status"] == {}
    assert only["itl_ms"]["count"] == 6 * 19  # every token timestamped, first one excluded per request
    assert only["token_throughput_per_s"] > 0 and only["ttft_ms"]["p99"] >= only["ttft_ms"]["p50"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ITL @" in result.stdout
    server_says = httpx.get(server["base"] + "/version").json()  # what the figures were measured with
    assert only["server"]["threads"] == server_says["threads"] >= 1 and only["server"]["dtype"] == "float32"
    assert only["server"]["cpu_threads"] == server_says["cpu_threads"] and "CPU threads" in result.stdout


def test_open_loop_and_compare(server, tmp_path):
    out = tmp_path / "c.json"
    result = bench("--url", server["base"], "--compare", server["base"], "--rate", "20", "--requests", "4",
                   "--max-tokens", "5", "--out", str(out), "--plot", str(tmp_path / "c.png"))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert len(data) == 2 and all(r["succeeded"] == 4 and r["load"]["rate"] == 20 for r in data.values())


def completions_served(base: str) -> float:
    """linserve_requests_total of /v1/completions answered 200, from the server's own metrics."""
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith("linserve_requests_total{") and 'endpoint="/v1/completions"' in line \
                and 'status="200"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_several_processes_send_exactly_the_load_of_one(server, tmp_path):
    """--processes 3: the closed loop's 7 requests are sent once each (the server counts 7 + the warm-up), every
    token timestamped; the open loop's too; the result says what the client cost."""
    before = completions_served(server["base"])
    out = tmp_path / "p.json"
    result = bench("--url", server["base"], "--processes", "3", "--concurrency", "3", "--requests", "7",
                   "--max-tokens", "12", "--prompt-tokens", "8", "--out", str(out), "--plot", str(tmp_path / "p.png"))
    assert result.returncode == 0, result.stderr
    (only,) = json.loads(out.read_text()).values()
    assert only["succeeded"] == only["requests"] == 7 and only["itl_ms"]["count"] == 7 * 11
    assert only["client"]["processes"] == 3 and only["client"]["cpu_us_per_token"] > 0
    assert "client: 3 process(es)" in result.stdout
    assert completions_served(server["base"]) - before == 7 + 1
    result = bench("--url", server["base"], "--processes", "2", "--rate", "20", "--requests", "5",
                   "--max-tokens", "4", "--out", str(out), "--plot", str(tmp_path / "p.png"))
    assert result.returncode == 0, result.stderr
    (only,) = json.loads(out.read_text()).values()
    assert only["succeeded"] == 5 and only["client"]["processes"] == 2
    assert completions_served(server["base"]) - before == 7 + 1 + 5 + 1


def test_one_stream_keeps_one_connection_and_counts_every_token(server):
    """Against the real server: a stream's requests go over one kept connection (uvicorn keeps it alive), every
    token event is counted, and a refused request keeps the server's message."""
    import asyncio

    from linserve.server.bench.client import LoadSpec, discover_model, stream_one
    from linserve.server.bench.http_client import Client

    async def go():
        spec = LoadSpec(server["base"], max_tokens=9, prompt_tokens=4)
        async with Client(server["base"], {}, 60) as client:
            model = await discover_model(client, spec)
            records = [await stream_one(client, spec, model, "to be or not", 0.0, seed) for seed in range(3)]
            refused = await stream_one(client, LoadSpec(server["base"], max_tokens=-1), model, "x", 0.0, 0)
            return records, refused, client.opened

    records, refused, opened = asyncio.run(go())
    assert [(r.ok, len(r.token_times), r.completion_tokens) for r in records] == [(True, 9, 9)] * 3
    assert refused.status == 400 and "max_tokens" in refused.error and opened == 1


def test_how_many_processes_by_default(monkeypatch):
    from linserve.server.bench import processes
    from linserve.server.bench.client import LoadSpec

    monkeypatch.setattr(processes, "usable_cpus", lambda: 2)
    assert processes.processes_for(LoadSpec("u", concurrency=128), None) == 1  # a small machine's cores serve
    monkeypatch.setattr(processes, "usable_cpus", lambda: 16)
    assert [processes.processes_for(LoadSpec("u", concurrency=c), None) for c in (1, 8, 16, 32, 128)] == [1, 1, 2, 4, 4]
    assert processes.processes_for(LoadSpec("u", concurrency=None, rate=5.0), None) == 1
    assert processes.processes_for(LoadSpec("u", concurrency=3), 5) == 3  # at most one per stream
    shares = processes._shares(LoadSpec("u", concurrency=10), 4)
    assert [share.concurrency for share in shares] == [3, 3, 2, 2]


def test_unreachable_server_is_a_clear_error(tmp_path):
    result = bench("--url", "http://127.0.0.1:9", "--requests", "1", "--out", str(tmp_path / "x.json"))
    assert result.returncode == 2 and "cannot reach" in result.stderr


def test_statistics():
    assert describe([0.001, 0.002, 0.003, 0.004])["p50"] == pytest.approx(3.0)
    records = [RequestRecord(start=0, status=200, token_times=[0.1, 0.2, 0.4], prompt_tokens=10)]
    rows = itl_by_position(records, 10, bin_size=2)
    assert [(r["start"], r["count"]) for r in rows] == [(10, 1), (12, 1)]  # positions 11 and 12


def test_without_matplotlib_it_writes_the_json_and_says_why_no_plot(server, tmp_path):
    """The server image leaves plotting out (it is the `bench` extra): the load test still runs and reports."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = ("import sys; sys.modules['matplotlib'] = None; "  # its import fails as if it were absent
            "from linserve.server.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "bench", "--url", server["base"], "--requests", "2",
                             "--max-tokens", "4", "--out", str(out), "--plot", str(png)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text()) and not png.exists()
    assert "no plot: matplotlib is not installed; pip install 'linserve[bench]'" in result.stdout
