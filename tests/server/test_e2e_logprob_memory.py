"""Issue 31 row 6: the memory that logprobs take is bounded and counted, against a real `linserve serve`: a
scoring request that could never fit is a 400 naming the limit, a burst of eight that do not fit beside each
other gets 429s with Retry-After for what would overflow, the process's peak RSS stays within the budget, and
every reservation is given back (answered, refused or abandoned by its client)."""

from __future__ import annotations

import threading

import httpx
import pytest

from linserve.server.api.common.logprob_budget import BYTES_PER_ALTERNATIVE, BYTES_PER_TOKEN
from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow

BUDGET_MB = 96
PER_TOKEN_TOP20 = BYTES_PER_TOKEN + 20 * BYTES_PER_ALTERNATIVE


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def scoring(tokens: int, top: int = 20, **extra) -> dict:
    ids = [(i * 7919) % 900 + 50 for i in range(tokens)]  # token ids of the tiny model's 1k vocabulary
    return {"prompt": ids, "echo": True, "logprobs": top, "max_tokens": 0, **extra}


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("logprob-memory")
    server = ServerProcess(tiny_checkpoint, directory / "server.log", "--session-store", "none",
                           env={"LINSERVE_LOGPROBS_MEMORY_MB": str(BUDGET_MB), "LINSERVE_MAX_PREFILL_CHUNK": "256"})
    yield server
    server.stop()


def test_a_request_that_could_never_fit_is_a_400_naming_the_limit(server):
    response = httpx.post(f"{server.base}/v1/completions", json=scoring(131_000), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "logprobs_too_large" and error["param"] == "logprobs"
    assert "logprobs_memory_mb" in error["message"] and f"{BUDGET_MB} MB" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
            "max_tokens": 500_000}  # a non-streamed answer keeps every token's logprobs
    response = httpx.post(f"{server.base}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "logprobs_too_large"
    assert httpx.post(f"{server.base}/v1/chat/completions", json={**chat, "stream": True, "max_tokens": 4},
                      timeout=60).status_code == 200  # streamed, they are written as they come


def test_eight_at_once_stay_within_the_budget(server):
    tokens = int(BUDGET_MB * 2**20 * 0.4 / PER_TOKEN_TOP20)  # two fit at once, a third does not
    warm = httpx.post(f"{server.base}/v1/completions", json=scoring(tokens), timeout=120)
    assert warm.status_code == 200 and len(warm.json()["choices"][0]["logprobs"]["tokens"]) == tokens
    before = peak_rss_mb(server.process.pid)
    statuses, barrier = [], threading.Barrier(8)

    def one() -> None:
        barrier.wait()
        response = httpx.post(f"{server.base}/v1/completions", json=scoring(tokens), timeout=120)
        if response.status_code == 429:
            assert response.headers["retry-after"] and response.json()["error"]["code"] == "logprobs_memory_full"
            assert "logprobs_memory_mb" in response.json()["error"]["message"]
        else:
            assert response.status_code == 200, response.text
        statuses.append(response.status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(set(statuses)) == [200, 429] and len(statuses) == 8, statuses  # two fit: 429 for the rest
    growth = peak_rss_mb(server.process.pid) - before
    assert growth <= BUDGET_MB, f"peak RSS grew {growth:.0f} MB past one request's, budget {BUDGET_MB} MB"
    assert_all_given_back(server)


def test_an_abandoned_stream_gives_its_reservation_back(server):
    tokens = int(BUDGET_MB * 2**20 * 0.6 / PER_TOKEN_TOP20)
    with httpx.stream("POST", f"{server.base}/v1/completions", json=scoring(tokens, stream=True, max_tokens=100_000,
                                                                           ignore_eos=True), timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the echo with its logprobs: then the client leaves mid-stream
    assert_all_given_back(server)


def assert_all_given_back(server) -> None:
    """A request that needs 95% of the budget is admitted: nothing else holds any (retried briefly: a closed
    stream gives its bytes back as its response ends)."""
    import time

    deadline = time.monotonic() + 10
    tokens = int(BUDGET_MB * 2**20 * 0.95 / PER_TOKEN_TOP20)
    while (response := httpx.post(f"{server.base}/v1/completions", json=scoring(tokens, max_tokens=1),
                                  timeout=120)).status_code == 429:
        assert time.monotonic() < deadline, "a reservation was never given back"
        time.sleep(0.2)
    assert response.status_code == 200, response.text
