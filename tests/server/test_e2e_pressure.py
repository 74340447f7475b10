"""Everything at once, against the split server with two frontends and too few slots: streams a client leaves
half-way, sampled batches of n rows, session turns, forks and deletes (sessions spilling past the device tier into
host memory and the store), a session two clients continue at once, a session turn left half-way and then
continued, stored Responses continued and deleted, JSON-schema outputs, the greedy reference request at any
priority and speculating or not, and bad requests — from many clients for a few seconds. Then: no answer was a
5xx or hung, every refusal was a 4xx with a JSON error saying why, the engine is idle with its slots balanced
(slots in use == the sessions left on the device tier), the sessions listed are exactly the ones never deleted,
and the same greedy requests give the same tokens they gave before the storm and on a fresh session with the same
history (invariants 2, 3 and 5 under load). A SIGTERM and a restart under load: test_e2e_pressure_restart.py."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import ServerProcess, metric

pytestmark = pytest.mark.slow

CLIENTS = 12
STORM_S = 8.0
TIMEOUT_S = 60.0  # any one answer (a hang fails the test)
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
REFERENCE = {"prompt": "ROMEO.", **GREEDY}
KEPT_SESSIONS = 5  # sessions left alive at most (the limit: 2 in host memory + 6 slots - 2 reserved)
WITNESS_PROMPT, WITNESS_TURNS = "KING.", [" My lord", " and", " the queen"]


@pytest.fixture(scope="module")
def crowded(tiny_checkpoint, tmp_path_factory):
    """Six slots (two kept for stateless work), two sessions in host memory, then the store; a short queue;
    priority scheduling."""
    process = ServerProcess(tiny_checkpoint, tmp_path_factory.mktemp("pressure") / "serve.log", "--api-servers", "2",
                            "--num-slots", "6", "--reserved-slots", "2", "--max-host-sessions", "2",
                            "--max-waiting", "6", "--max-n", "2", "--scheduling-policy", "priority")
    yield process
    process.stop()


class Outcomes:
    """Every answer's status (thread-safe), and what was wrong with any."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: dict[int, int] = {}
        self.problems: list[str] = []
        self.alive: set[str] = set()  # sessions created and not deleted

    def saw(self, what: str, response: httpx.Response, allowed: tuple[int, ...]) -> bool:
        """Records the answer; True when it is a 2xx. A refusal must be an allowed 4xx with a JSON error."""
        with self.lock:
            self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        if response.status_code < 300:
            return True
        if response.status_code not in allowed:
            self.problem(f"{what}: {response.status_code} {response.text[:300]}")
            return False
        if response.status_code == 429:
            time.sleep(0.05)  # (a client backs off a little before its next request, as Retry-After asks)
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            self.problem(f"{what}: {response.status_code} without a JSON error: {response.text[:300]}")
            return False
        if not message:
            self.problem(f"{what}: {response.status_code} with an empty message")
        return False

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)


def leave_a_stream(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    body = {"prompt": rng.choice(["ROMEO.", "To be", "HAMLET."]), "max_tokens": rng.randint(4, 60),
            "temperature": 0.8, "stream": True, "priority": rng.randint(-3, 3)}
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            outcomes.saw("stream", response, (429,))
            return
        outcomes.saw("stream", response, ())
        leave_after = rng.randint(1, 20)
        for count, line in enumerate(response.iter_lines()):
            if count >= leave_after:  # the client goes away mid-stream: its row must come back
                break
            if line.startswith("data: ") and line != "data: [DONE]" and "error" in json.loads(line[6:]):
                outcomes.problem(f"stream error event: {line[:300]}")


def sample_n_rows(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    body = {"prompt": "HAMLET.", "max_tokens": rng.randint(1, 16), "n": 2, "temperature": 1.0,
            "seed": rng.randint(0, 1000), "logprobs": 2, "priority": rng.randint(-3, 3)}
    response = client.post("/v1/completions", json=body)
    if outcomes.saw("n rows", response, (429,)) and len(response.json()["choices"]) != 2:
        outcomes.problem(f"n rows: {response.text[:300]}")


def session_life(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    created = client.post("/v1/sessions", json={"prompt": rng.choice(["KING.", "QUEEN."])})
    if not outcomes.saw("create", created, (429,)):
        return
    sid = created.json()["id"]
    with outcomes.lock:
        outcomes.alive.add(sid)
    turn = client.post(f"/v1/sessions/{sid}/completions", json={"prompt": " Well", "max_tokens": rng.randint(1, 8),
                                                                "priority": rng.randint(-3, 3)})
    outcomes.saw("turn", turn, (429,))
    fork = client.post(f"/v1/sessions/{sid}/fork")
    if outcomes.saw("fork", fork, (429,)):
        with outcomes.lock:
            outcomes.alive.add(fork.json()["id"])
    with outcomes.lock:  # some stay: idle sessions past the device tier (4) in host memory, up to the limit (6)
        stay = len(outcomes.alive) <= KEPT_SESSIONS and rng.random() < 0.3
    if not stay:
        for other in [sid] + ([fork.json()["id"]] if fork.status_code == 200 else []):
            if outcomes.saw("delete", client.delete(f"/v1/sessions/{other}"), ()):
                with outcomes.lock:
                    outcomes.alive.discard(other)


def leave_a_session_turn(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    """A session's streamed turn left half-way, then its next turn: the session is free again and goes on."""
    created = client.post("/v1/sessions", json={"prompt": "QUEEN."})
    if not outcomes.saw("create", created, (429,)):
        return
    sid = created.json()["id"]
    with outcomes.lock:
        outcomes.alive.add(sid)
    body = {"prompt": " Now", "max_tokens": 200, "ignore_eos": True, "stream": True, "priority": rng.randint(-3, 3)}
    with client.stream("POST", f"/v1/sessions/{sid}/completions", json=body) as response:
        if response.status_code == 200:
            outcomes.saw("left turn", response, ())
            for count, _ in enumerate(response.iter_lines()):
                if count >= rng.randint(1, 10):
                    break
        else:
            response.read()
            outcomes.saw("left turn", response, (429,))
    for _ in range(100):  # (its 429s waited out: the session must not stay busy — a 409 is a problem)
        after = client.post(f"/v1/sessions/{sid}/completions", json={"prompt": " Then", "max_tokens": 4})
        if outcomes.saw("turn after leaving", after, (429,)) or after.status_code != 429:
            break
    if outcomes.saw("delete", client.delete(f"/v1/sessions/{sid}"), ()):
        with outcomes.lock:
            outcomes.alive.discard(sid)


def bad_requests(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    bad = rng.choice([
        lambda: client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}),
        lambda: client.post("/v1/completions", json={"prompt": "x", "n": 99}),
        lambda: client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
        lambda: client.post("/v1/sessions/sess-doesnotexist0000000000/completions", json={"prompt": "x"}),
        lambda: client.post("/v1/chat/completions", json={"messages": "hello"}),
    ])
    response = bad()  # never a 429 either: retrying it later could not help
    if response.status_code < 400 or response.status_code >= 500:
        outcomes.problem(f"bad request answered {response.status_code}: {response.text[:300]}")
    else:
        outcomes.saw("bad request", response, (400, 404, 422))


def greedy_probe(client: httpx.Client, outcomes: Outcomes, rng: random.Random, reference: str) -> None:
    """The reference request among the others, at any priority, speculating or not: the same tokens."""
    body = {**REFERENCE, "priority": rng.randint(-3, 3),
            **({"speculative": {"method": "ngram", "k": 4}} if rng.random() < 0.5 else {})}
    response = client.post("/v1/completions", json=body)
    if outcomes.saw("probe", response, (429,)) and response.json()["choices"][0]["text"] != reference:
        outcomes.problem(f"probe {body}: {response.json()['choices'][0]['text']!r} != {reference!r}")


def structured(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 64, "seed": rng.randint(0, 99),
            "response_format": {"type": "json_schema", "json_schema": {"name": "who", "schema": schema}}}
    response = client.post("/v1/chat/completions", json=body)
    if outcomes.saw("structured", response, (429,)):
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":  # (a grammar's end: the object is whole)
            try:
                parsed = json.loads(choice["message"]["content"])
                assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int)
            except (ValueError, AssertionError):
                outcomes.problem(f"structured output does not fit its schema: {choice['message']['content']!r}")


def conversation(client: httpx.Client, outcomes: Outcomes, rng: random.Random) -> None:
    """A stored response, continued once, then its conversation (a session) deleted; or one not stored."""
    stored = rng.random() < 0.6
    first = client.post("/v1/responses", json={"input": "Speak.", "max_output_tokens": rng.randint(1, 8),
                                               "store": stored})
    if not outcomes.saw("response", first, (429,)) or not stored:
        return
    sid = "sess-" + first.json()["id"].split("_")[1]
    with outcomes.lock:
        outcomes.alive.add(sid)
    follow = client.post("/v1/responses", json={"input": "More.", "max_output_tokens": 4,
                                                "previous_response_id": first.json()["id"]})
    outcomes.saw("follow-up", follow, (429,))
    if outcomes.saw("delete conversation", client.delete(f"/v1/sessions/{sid}"), ()):
        with outcomes.lock:
            outcomes.alive.discard(sid)


def both_at_once(client: httpx.Client, outcomes: Outcomes, shared: str) -> None:
    """Two turns of one session at the same time: each is served or a 409 (busy), never both corrupted."""
    body = {"prompt": " And", "max_tokens": 6}
    with ThreadPoolExecutor(2) as pair:
        answers = list(pair.map(lambda _: client.post(f"/v1/sessions/{shared}/completions", json=body), range(2)))
    for response in answers:
        outcomes.saw("shared turn", response, (409, 429))


def new_witness(base: str) -> str:
    created = httpx.post(f"{base}/v1/sessions", json={"prompt": WITNESS_PROMPT}, timeout=TIMEOUT_S)
    assert created.status_code == 200, created.text
    return created.json()["id"]


def witness_turns(client: httpx.Client, outcomes: Outcomes, sid: str) -> list[str]:
    """The witness session's greedy turns (a full queue's 429 waited out)."""
    texts = []
    for prompt in WITNESS_TURNS:
        while True:
            turn = client.post(f"/v1/sessions/{sid}/completions", json={"prompt": prompt, **GREEDY})
            if turn.status_code != 429:
                break
            outcomes.saw("witness turn", turn, (429,))
        assert outcomes.saw("witness turn", turn, ()), turn.text
        texts.append(turn.json()["choices"][0]["text"])
    return texts


def refusals_counted(base: str) -> dict[int, int]:
    """`linserve_requests_total` of every status from 300 up, summed over endpoints."""
    counted = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("linserve_requests_total{"):
            status = int(line.split('status="')[1].split('"')[0])
            if status >= 300:
                counted[status] = counted.get(status, 0) + int(float(line.split()[-1]))
    return counted


def test_a_storm_of_mixed_clients_leaves_no_5xx_no_leak_and_the_same_tokens(crowded):
    base = crowded.base
    reference = httpx.post(f"{base}/v1/completions", json=REFERENCE, timeout=TIMEOUT_S).json()["choices"][0]["text"]
    shared = httpx.post(f"{base}/v1/sessions", json={"prompt": "QUEEN."}, timeout=TIMEOUT_S).json()["id"]
    witnessed_sid = new_witness(base)  # (before the storm fills the session limit)
    outcomes = Outcomes()
    outcomes.alive |= {shared, witnessed_sid}
    deadline = time.monotonic() + STORM_S

    actions = {  # what a client does next, as often as it is listed
        "stream": leave_a_stream, "stream again": leave_a_stream, "n rows": sample_n_rows, "session": session_life,
        "bad": bad_requests, "structured": structured, "conversation": conversation, "left turn": leave_a_session_turn,
        "probe": lambda client, outcomes, rng: greedy_probe(client, outcomes, rng, reference),
        "shared": lambda client, outcomes, rng: both_at_once(client, outcomes, shared),
    }

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
            while time.monotonic() < deadline:
                action = rng.choice(list(actions))
                try:
                    actions[action](client, outcomes, rng)
                except httpx.HTTPError as error:  # a timeout is a hang; a closed connection a crash
                    outcomes.problem(f"{action}: {error!r}")

    with ThreadPoolExecutor(CLIENTS + 1) as pool:
        storm = [pool.submit(client_loop, seed) for seed in range(CLIENTS)]
        with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
            witnessed = pool.submit(witness_turns, client, outcomes, witnessed_sid).result()
        for future in storm:
            future.result()

    assert not outcomes.problems, "\n".join(outcomes.problems[:20])
    assert sum(outcomes.statuses.values()) > 50, outcomes.statuses  # (it was a storm)
    assert outcomes.statuses.get(409, 0) + outcomes.statuses.get(429, 0) > 0, outcomes.statuses  # (it was crowded)
    assert metric(base, "linserve_preemptions_total") > 0  # (urgent arrivals parked running rows, sessions' too)

    # idle, and the slots balance: in use == the sessions left on the device tier
    for name in ("linserve_requests_running", "linserve_requests_waiting"):
        deadline = time.monotonic() + 20
        while metric(base, name) != 0:
            assert time.monotonic() < deadline, f"{name} stayed {metric(base, name)}"
            time.sleep(0.1)
    per_session = metric(base, "linserve_state_bytes_per_session")
    in_use = metric(base, 'linserve_state_pool_bytes{kind="in_use"}')
    assert in_use / per_session == metric(base, 'linserve_sessions{tier="device"}')
    # every refusal counted once, whichever frontend answered it: one /metrics sums them all (a frontend counts a
    # request once its answer is sent, and tells the core after: a moment later at most)
    seen = {code: n for code, n in outcomes.statuses.items() if code >= 300}
    deadline = time.monotonic() + 10
    while (counted := refusals_counted(base)) != seen and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counted == seen
    listed, after = set(), None
    while True:
        page = httpx.get(f"{base}/v1/sessions", params={"limit": 100, **({"after": after} if after else {})}).json()
        listed |= {entry["id"] for entry in page["data"]}
        if not page.get("has_more"):
            break
        after = page["data"][-1]["id"]
    assert listed == outcomes.alive

    # the same tokens as before the storm, and the witness's turns as a quiet server gives them to a new session
    again = httpx.post(f"{base}/v1/completions", json=REFERENCE, timeout=TIMEOUT_S).json()["choices"][0]["text"]
    assert again == reference
    for sid in outcomes.alive:
        assert httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 204
    quiet_sid = new_witness(base)
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client:
        assert witness_turns(client, outcomes, quiet_sid) == witnessed
    assert httpx.delete(f"{base}/v1/sessions/{quiet_sid}").status_code == 204
    assert metric(base, 'linserve_state_pool_bytes{kind="in_use"}') == 0

