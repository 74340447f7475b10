"""What tests share, imported by name (`from tests.helpers import run, Collector`): the tiny model config,
engine helpers (a sink that collects outputs, a blocking `run`, the slot-balance check, an EngineConfig
from the settings' defaults), real server processes and real programs (redis-server, promtool, …)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from linserve.model import ModelConfig
from linserve.server.engine import Engine, EngineConfig, EngineRequest, RequestOutput, SamplingParams
from linserve.server.engine.proc_stat import stat_fields
from linserve.server.settings import Settings
from tests.devices import device_name_under_test

TINY = ModelConfig(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, conv_kernel=3, decay=True, chunk_size=16)


def require_program(name: str, package: str) -> str:
    """The path of an external program the test runs. Missing: a skip saying what to install on a
    developer's machine; a failure in CI (`CI` set), where `.ci/run` installs every one of them."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is required (Debian package '{package}'; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # the engine tests' usual request


def require_kernel() -> None:
    """linserve's kernels (model/kernels) are built with the C++ compiler: missing, a skip on a developer's
    machine, a failure in CI."""
    from linserve.model import kernels

    if not kernels.load():
        message = f"the kernel could not be built: {kernels.load_error()}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@contextlib.contextmanager
def server_threads(model, device: torch.device):
    """While a test makes a CPU program's step (DecodeStep): torch's thread count on this thread set to the decode
    count a server gives `model` (cpu_threads.plan_threads, unasked). A program's compile key holds the count it was
    made on, and torch's own default here (every CPU) is no server's — nor the same from test to test, once one has
    set it: so the tests' buckets and the engines', servers' and benchmarks' are the same builds, one a run."""
    from linserve.server.engine.cpu_threads import plan_threads, weight_bytes

    before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(plan_threads(None, weight_bytes=weight_bytes(model)).threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prompt(n: int, seed: int = 0, vocab: int = 1024) -> list[int]:
    """n reproducible random token ids (never 0)."""
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_config(**overrides) -> EngineConfig:
    """The engine's config as `linserve serve` builds it from the settings' defaults — eager (compiled builds,
    when asked for, without max-autotune), no store, a small pool and prefill chunk for the tiny model — with
    `overrides` (any EngineConfig field)."""
    base = {"compile": "off", "compile_autotune": False, "session_store": "none", "num_slots": 24,
            "max_prefill_chunk": 16, "max_batch_tokens": 64}
    return EngineConfig.from_settings(Settings(**{**base, **overrides}))


class Collector:
    """A thread-safe sink that gathers one request's outputs."""

    def __init__(self) -> None:
        self.queue: queue.Queue[RequestOutput] = queue.Queue()

    def __call__(self, output: RequestOutput) -> None:
        self.queue.put(output)

    def wait(self, rows: int = 1, timeout: float = 60.0) -> list[RequestOutput]:
        outputs, finished = [], 0
        while finished < rows:
            output = self.queue.get(timeout=timeout)
            outputs.append(output)
            finished += output.finished
        return outputs


def tokens_of(outputs: list[RequestOutput], index: int = 0) -> list[int]:
    return [o.token_id for o in outputs if o.index == index and o.token_id is not None]


def run(engine: Engine, prompt: list[int], params: SamplingParams, request_id: str, session_id=None, owner=None):
    sink = Collector()
    engine.submit(EngineRequest(request_id, prompt, params, session_id=session_id, owner=owner), sink).result(10)
    return sink.wait(params.n)


def assert_slots_balance(engine: Engine) -> dict:
    """Design invariant 5, taken on the engine thread: slots in use == running rows + device-tier sessions,
    no slot held twice or free twice, pool bytes == slots × state bytes."""
    a = engine.slot_accounting().result(10)
    assert a["slots_in_use"] == a["running_rows"] + a["device_sessions"], a
    assert a["counted_device_sessions"] == a["device_sessions"], a  # the tiers' running count, recounted
    assert a["distinct_session_slots"] == a["device_sessions"] and a["distinct_row_slots"] == a["row_slots"], a
    assert a["distinct_free"] == a["free_list"] == a["num_slots"] - a["slots_in_use"], a
    assert a["bytes_in_use"] == a["slots_in_use"] * a["slot_bytes"], a
    assert a["speculating"] == a["counted_speculating"], a  # the step's count of speculating requests
    return a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(base: str, name: str) -> float:
    """A server's metric from /metrics: `name` exactly as exposed (labels included, e.g.
    'linserve_sessions{tier="device"}'), or a labelled family's first series."""
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in {base}/metrics")


class ServerProcess:
    """A real `linserve serve` on a free 127.0.0.1 port; stopped with SIGTERM."""

    def __init__(self, checkpoint, log_path, *extra: str, env: dict | None = None,
                 entry: tuple[str, ...] = ("-m", "linserve.server.cli"), prefix: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log, self.checkpoint = log_path, checkpoint
        # eager unless a test asks: compiling takes minutes of CPU (the compiled server has its own test)
        # (pytest's `--api-servers`: the placement of every server whose test does not choose one)
        placement = os.environ.get("LINSERVE_TEST_API_SERVERS")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LINSERVE_MAX_PREFILL_CHUNK": "16", "LINSERVE_COMPILE": "off",
               "LINSERVE_SESSION_STORE": f"dir:{log_path.parent / 'sessions'}",
               **({"LINSERVE_API_SERVERS": placement} if placement else {}), **(env or {})}
        command = [*prefix, sys.executable, *entry, "serve", "--model", str(checkpoint), "--port", str(self.port),
                   "--device", device_name_under_test(), "--log-level", "warning", *extra]
        with open(log_path, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base}/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"linserve serve exited: {log_path.read_text()[-2000:]}")
            time.sleep(0.2)
        self.process.kill()
        raise RuntimeError(f"linserve serve did not become ready: {log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __getitem__(self, key: str):
        return getattr(self, key)


def assert_json_schema_answer(base: str) -> None:
    """A chat request under a small `json_schema` answers JSON that the schema's type holds (a served model of any
    family or vocabulary, through the grammar engine's view of it)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}})
    assert reply.status_code == 200, reply.text
    assert isinstance(json.loads(reply.json()["choices"][0]["message"]["content"])["ok"], bool)


def start_redis(directory, port: int | None = None, durable: bool = False) -> tuple[str, subprocess.Popen]:
    """A real redis-server (Debian's package; `.ci/run` installs it) on 127.0.0.1 (a free port unless given):
    (url, process). `durable`: every write appended to its file and fsync'd, so it survives a SIGKILL."""
    binary = require_program("redis-server", "redis-server")
    port = port or free_port()
    persistence = ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence,
                                "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0", process




def poison_sampling(monkeypatch, temperature: float, times: int | None = None) -> dict:
    """Make the engine's step fail for batches holding a row with this temperature — after the decode program ran
    (it wrote the rows' state and counts) and before the tokens are delivered — `times` times (None: always;
    `armed["n"]` re-arms)."""
    from linserve.server.engine.step_runner import StepRunner

    real = StepRunner._sampled
    armed = {"n": times}

    def sampled(self, rows, out, *args, **kwargs):
        if armed["n"] != 0 and any(row.live.request.params.temperature == temperature for row in rows):
            if armed["n"] is not None:
                armed["n"] -= 1
            raise RuntimeError("injected sampler fault")
        return real(self, rows, out, *args, **kwargs)

    monkeypatch.setattr(StepRunner, "_sampled", sampled)
    return armed


class ReplyDroppingProxy:
    """A TCP relay in front of a real redis-server that loses the answer to one chosen command: armed with some
    bytes (a Lua script's sha), the next connection that sends them gets no reply from then on — the command
    runs in Redis, its answer never arrives (a network that fails after the send). What a store call then
    sees is a timeout with the change made: the ambiguous outcome."""

    def __init__(self, redis_port: int) -> None:
        import socketserver

        self.redis_port, self.armed, self.dropped = redis_port, None, 0
        self.swallowing = None  # bytes: the next command carrying them never reaches Redis (nor does any answer)
        proxy = self

        class Relay(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                upstream = socket.create_connection(("127.0.0.1", proxy.redis_port))
                state = {"drop": False}

                def answers() -> None:
                    try:
                        while data := upstream.recv(65536):
                            if not state["drop"]:
                                self.request.sendall(data)
                    except OSError:
                        pass

                reader = threading.Thread(target=answers, daemon=True)
                reader.start()
                try:
                    while data := self.request.recv(65536):
                        if proxy.armed is not None and proxy.armed in data:
                            proxy.armed, state["drop"] = None, True
                            proxy.dropped += 1
                        if proxy.swallowing is not None and proxy.swallowing in data:
                            proxy.swallowing, state["drop"] = None, True
                            continue  # lost on the way: it never runs
                        upstream.sendall(data)
                except OSError:
                    pass
                finally:
                    upstream.close()
                    reader.join(5)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self.server = Server(("127.0.0.1", 0), Relay)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def arm(self, marker: bytes) -> None:
        self.armed = marker

    def swallow(self, marker: bytes) -> None:
        """The next command carrying `marker` is lost before Redis: it times out having changed nothing."""
        self.swallowing = marker

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def parent_pid(pid: int) -> int | None:
    """The parent of a running process (None once it is gone)."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (not its resource tracker), oldest first: under
    `linserve serve` the engine core, then (`--api-servers` N > 1) the N frontends."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and parent_pid(int(entry.name)) == pid \
                    and "multiprocessing.spawn" in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return sorted(found)
