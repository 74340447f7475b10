"""A session's turn text through HTTP against a real `linserve serve` with a `dir:` store: `GET
/v1/sessions/{id}/turns` returns each turn's prompt and completion as the server kept them — per session, within
`session_text_chars`, through a restart, export/import and fork (as turn 0), and cut back by a rewind."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow


def turn(base: str, session_id: str, text: str) -> str:
    body = {"prompt": text, "max_tokens": 6, "temperature": 0}
    return httpx.post(f"{base}/v1/sessions/{session_id}/completions", json=body).json()["choices"][0]["text"]


def test_turn_text_is_kept_per_session_and_survives_a_restart(tiny_checkpoint, tmp_path):
    args = (tiny_checkpoint, tmp_path / "a.log", "--session-store", f"dir:{tmp_path / 'store'}")
    server = ServerProcess(*args, env={"LINSERVE_SESSION_TEXT_CHARS": "120"})
    try:
        base = server.base
        ids = {name: httpx.post(f"{base}/v1/sessions", json={"prompt": name}).json()["id"]
               for name in ("JULIET.", "HAMLET.")}
        said = {sid: [(name, "")] for name, sid in ids.items()}
        for sid in ids.values():
            said[sid].append((" Speak", turn(base, sid, " Speak")))
        for sid in ids.values():
            turns = httpx.get(f"{base}/v1/sessions/{sid}/turns").json()
            assert [(t["prompt"], t["completion"]) for t in turns] == said[sid]
            assert [t["rewindable"] for t in turns] == [True, True]
        juliet = ids["JULIET."]
        for i in range(8):  # past 120 characters: the oldest turns' text goes, their snapshots may stay
            turn(base, juliet, f" again {i}")
        kept = [t for t in httpx.get(f"{base}/v1/sessions/{juliet}/turns").json() if t["prompt"] is not None]
        assert sum(len(t["prompt"]) + len(t["completion"]) for t in kept) <= 120 and kept[-1]["prompt"] == " again 7"
        before = httpx.get(f"{base}/v1/sessions/{juliet}/turns").json()
        exported = httpx.get(f"{base}/v1/sessions/{juliet}/state").content
    finally:
        server.stop()
    server = ServerProcess(*args[:1], tmp_path / "b.log", *args[2:], env={"LINSERVE_SESSION_TEXT_CHARS": "120"})
    try:
        base = server.base
        assert httpx.get(f"{base}/v1/sessions/{juliet}/turns").json() == before  # from the store's record
        hamlet = ids["HAMLET."]
        assert "JULIET" not in str(httpx.get(f"{base}/v1/sessions/{hamlet}/turns").json())
        imported = httpx.post(f"{base}/v1/sessions/import", content=exported).json()["id"]
        copied = httpx.get(f"{base}/v1/sessions/{imported}/turns").json()
        assert [t["turn"] for t in copied] == [0] * len(kept) and copied[-1]["prompt"] == " again 7"
        assert not any(t["rewindable"] for t in copied)
        fork = httpx.post(f"{base}/v1/sessions/{hamlet}/fork").json()["id"]
        assert [t["prompt"] for t in httpx.get(f"{base}/v1/sessions/{fork}/turns").json()] == ["HAMLET.", " Speak"]
        httpx.post(f"{base}/v1/sessions/{hamlet}/rewind", json={"turn": 1})
        assert [t["prompt"] for t in httpx.get(f"{base}/v1/sessions/{hamlet}/turns").json()] == ["HAMLET."]
    finally:
        server.stop()
