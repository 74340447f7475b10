"""Speculative decoding through HTTP against a real `linserve serve` on the shipped model: the `speculative`
field on completions, chat and responses; the same text as without it; the counters and /ready; clear 400s."""

from __future__ import annotations

import httpx
import pytest

from linserve.model.loading import DEFAULT_CHECKPOINT
from tests.helpers import ServerProcess, metric

pytestmark = pytest.mark.slow

PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks?\n"


def test_speculative_requests_return_what_plain_ones_do(tmp_path):
    server = ServerProcess(DEFAULT_CHECKPOINT, tmp_path / "serve.log", "--speculative", "ngram",
                           "--speculative-k", "4")
    try:
        base = server.base
        ready = httpx.get(f"{base}/ready").json()
        assert ready["speculation"]["default"] == "ngram" and ready["speculation"]["k"] == 4
        body = {"prompt": PROMPT, "max_tokens": 96, "temperature": 0}
        plain = httpx.post(f"{base}/v1/completions", json={**body, "speculative": {"method": "off"}}, timeout=120)
        assert plain.status_code == 200, plain.text
        assert metric(base, "linserve_spec_draft_tokens_total") == 0
        fast = httpx.post(f"{base}/v1/completions", json=body, timeout=120)  # the server's default: ngram
        assert fast.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert fast.json()["usage"] == plain.json()["usage"]
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True,
                                                                  "speculative": {"method": "ngram", "k": 2}},
                          timeout=120) as stream:
            text = "".join(
                __import__("json").loads(line[6:])["choices"][0]["text"] for line in stream.iter_lines()
                if line.startswith("data: {"))
        assert text == plain.json()["choices"][0]["text"]
        drafted = metric(base, "linserve_spec_draft_tokens_total")
        assert drafted > 0 and 0 <= metric(base, "linserve_spec_accepted_tokens_total") <= drafted

        chat = {"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 24, "temperature": 0}
        a = httpx.post(f"{base}/v1/chat/completions", json={**chat, "speculative": {"method": "ngram"}}, timeout=60)
        b = httpx.post(f"{base}/v1/chat/completions", json={**chat, "speculative": {"method": "off"}}, timeout=60)
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
        r = httpx.post(f"{base}/v1/responses", json={"input": "Speak.", "max_output_tokens": 16, "temperature": 0,
                                                      "store": False, "speculative": {"method": "ngram", "k": 3}},
                       timeout=60)
        assert r.status_code == 200, r.text

        for wrong, param in (({"method": "ngram", "k": 5}, "speculative"), ({"method": "medusa"}, "speculative"),
                             ({"k": 2}, "speculative"), ({"method": "ngram", "k": 0}, "speculative"),
                             ({"method": "draft"}, "speculative")):  # no draft model is shipped or given
            response = httpx.post(f"{base}/v1/completions", json={**body, "speculative": wrong}, timeout=30)
            assert response.status_code == 400, (wrong, response.text)
            assert response.json()["error"]["param"].startswith(param), response.json()
    finally:
        server.stop()
