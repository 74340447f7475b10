"""benchmarks/common.py's helpers: the machine's drift check and the waits for a server's programs to settle."""

from __future__ import annotations

import json
import sys
import time

from tests.benchmarks import BENCHMARKS


def test_machine_check_judges_drift():
    sys.path.insert(0, str(BENCHMARKS))
    from common import machine_check, reference_workload_ms

    assert machine_check(10.0, 10.4)["pass"] and not machine_check(10.0, 11.0)["pass"]
    assert not machine_check(10.0, 9.0)["pass"]
    assert reference_workload_ms(reps=3) > 0


def test_compile_settled_waits_for_the_prefill_program_too():
    """A benchmark measures only once nothing compiles beside it: the decode step's buckets and the prefill
    program's (a compile takes a core; /ready's body nests the prefill program's status under the decode step's)."""
    sys.path.insert(0, str(BENCHMARKS))
    from common import compile_settled

    assert compile_settled({"decode_step": None})  # the softmax baseline: nothing to compile
    assert compile_settled({"decode_step": {"status": "compiled"}})  # no prefill program (a GPU, a large model)
    assert not compile_settled({"decode_step": {"status": "compiling"}})
    assert not compile_settled({"decode_step": {"status": "compiled", "prefill": {"status": "pending"}}})
    assert not compile_settled({"decode_step": {"status": "compiled", "prefill": {"status": "compiling"}}})
    assert compile_settled({"decode_step": {"status": "compiled", "prefill": {"status": "declined"}}})
    assert compile_settled({"decode_step": {"status": "eager", "prefill": {"status": "eager"}}})


def test_wait_settled_gives_up_after_its_time_and_returns_at_once_when_settled():
    """`--compile-wait`: a server still compiling is measured after that long (a GPU lease is short), one that
    has settled at once."""
    import http.server
    import threading

    sys.path.insert(0, str(BENCHMARKS))
    from common import wait_settled

    status = {"value": "compiling"}

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            body = json.dumps({"decode_step": {"status": status["value"]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ready"
    try:
        started = time.monotonic()
        assert wait_settled(url, 0.6, poll_s=0.1) is False and time.monotonic() - started >= 0.6
        status["value"] = "compiled"
        started = time.monotonic()
        assert wait_settled(url, 30, poll_s=0.1) is True and time.monotonic() - started < 10
    finally:
        server.shutdown()
